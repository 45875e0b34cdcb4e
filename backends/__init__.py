"""linrec: a compiler for linear-attention recurrences.

    import linrec
    rec = linrec.load("examples/gla.lin")
    result = rec.run(rec.random_inputs(batch=1, tokens=32, heads=2))

`import linrec` is cheap: the names below and the submodules (`linrec.api`, `linrec.bench`, ...) are imported
when first used (PEP 562), so that `linrec.command`, the `linrec` command's entry point, runs before NumPy,
lark, jinja2 and the compiler are imported and can catch a Ctrl-C while they are.
"""
import importlib

# each public name → (the module that defines it, relative to this package; its name there)
_EXPORTS = {
    "Recurrence": (".api", "Recurrence"),
    "Result": (".api", "Result"),
    "compile": (".api", "compile"),
    "load": (".api", "load"),
    "from_bfloat16": (".arrays", "from_bfloat16"),
    "to_bfloat16": (".arrays", "to_bfloat16"),
    "LinrecError": (".dsl.errors", "LinrecError"),
    "RuntimeInputError": (".dsl.errors", "RuntimeInputError"),
    "__version__": (".version", "VERSION"),
}

__all__ = ["LinrecError", "Recurrence", "Result", "RuntimeInputError", "__version__", "compile", "from_bfloat16", "load", "to_bfloat16"]


def __getattr__(name: str):
    """A public name, imported from its module on first use (and kept), or a submodule (`linrec.bench`)."""
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        value = getattr(importlib.import_module(module, __name__), attribute)
        globals()[name] = value
        return value
    if not name.startswith("_"):  # (never __main__, which is the command; nor the probes of dunder names)
        try:
            return importlib.import_module(f"{__name__}.{name}")  # (the import sets it on this package)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":  # a submodule that exists and failed to import: its error
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
