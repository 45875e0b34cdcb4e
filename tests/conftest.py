"""Make the project's packages (dsl, compiler, backends) and tests/reference_impls importable however
pytest is started (`python -m pytest tests` or plain `pytest`)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
