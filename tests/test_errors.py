"""Every class of bad program and bad call: the message, and the exact FILE:LINE:COL with a caret line.

Expected columns are computed from the source text itself (the position of the offending fragment in its
line), not copied from linrec's output.
"""
from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec.dsl.errors import LinrecError, RuntimeInputError, source_lines

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FILE = "bad.lin"
HEAD = "recurrence t(dk = 4, dv = 3)\ninput q[dk], k[dk], v[dv]\n"
SQUARE_HEAD = "recurrence t(dk = 4)\ninput q[dk], k[dk], v[dk]\n"


def compile_error(source: str) -> LinrecError:
    with pytest.raises(LinrecError) as info:
        linrec.compile(source, FILE)
    assert not isinstance(info.value, RuntimeInputError)
    return info.value


def where(source: str, line: int, fragment: str, occurrence: int = 1) -> tuple[int, int]:
    """(line, column) of the n-th occurrence of `fragment` in line `line` of source (1-based)."""
    text = _line(source, line)
    col = -1
    for _ in range(occurrence):
        col = text.index(fragment, col + 1)
    return line, col + 1


def end_of(source: str, line: int) -> tuple[int, int]:
    """(line, column) just past the last character of a line: where 'unexpected end of line' points."""
    return line, len(_line(source, line)) + 1


def _line(source: str, line: int) -> str:
    """Line `line` of source (1-based), as the parser counts lines (without a CR before its end)."""
    return source_lines(source)[line - 1].removesuffix("\r")


def check(err: LinrecError, source: str, pos: tuple[int, int], *fragments: str, width: int | None = None):
    line, col = pos
    assert err.span is not None, str(err)
    assert (err.span.line, err.span.column) == (line, col), str(err)
    text = str(err)
    lines = text.splitlines()
    assert lines[0].startswith(f"{FILE}:{line}:{col}: error: "), text
    for f in fragments:
        assert f in lines[0], f"{f!r} not in {lines[0]!r}"
    # the quoted source line and a caret under the offending column
    assert len(lines) == 3, text
    assert lines[1] == "  " + _line(source, line)
    m = re.fullmatch(r"  ( *)(\^+)", lines[2])
    assert m, repr(lines[2])
    assert len(m.group(1)) == col - 1, text
    if width is not None:
        assert len(m.group(2)) == width, text


# ---- syntax --------------------------------------------------------------------------------------
def test_stray_closing_parenthesis():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v )\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, ")"), "unexpected ')'", "expected end of line", width=1)


def test_the_caret_keeps_the_lines_tabs():
    """A tab before the place: the caret line has it too, so the caret lines up however wide a tab shows
    (it had a space there: one column, against the tab's eight in a terminal)."""
    src = HEAD + "state S[dk, dv]\nS =\tS + k⊗w\noutput o = q·S\n"
    line, caret = str(compile_error(src)).splitlines()[-2:]
    assert line == "  S =\tS + k⊗w" and caret == "     \t      ^"


def test_stray_name_after_expression():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S q\n"
    err = compile_error(src)
    check(err, src, where(src, 5, "q", 2), "unexpected 'q'", width=1)
    # the most useful alternative is listed first and the operators are not cut off
    assert "expected end of line, " in str(err)
    assert "'·'" in str(err) and "'⊗'" in str(err)


def test_unclosed_parenthesis():
    src = HEAD + "state S[dk, dv]\nS = S + (k⊗v\noutput o = q·S\n"
    col_open = where(src, 4, "(")[1]
    check(compile_error(src), src, end_of(src, 4), "unexpected end of line", "expected ')'",
          f"the '(' at column {col_open} is never closed", width=1)


def test_state_without_a_shape():
    src = HEAD + "state S[dk, dv], c\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, end_of(src, 3), "unexpected end of line", "expected '['",
          "a state has a shape: a vector such as z[dk] or a matrix such as S[dk, dv]",
          "for a scalar, declare a dim of size 1 in the header, `one = 1`, write c[one]", width=1)


@pytest.mark.parametrize("update, fragments", [
    ("exp(k)*S", ("[dk] and [dk, dv]", "for its rows: diag(v)·M")),
    ("S*exp(v)", ("[dk, dv] and [dv]", "for its columns: M·diag(v)")),
])
def test_vector_times_matrix_elementwise_suggests_diag(update, fragments):
    src = HEAD + f"state S[dk, dv]\nS = {update} + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, update), "shape mismatch in '*'", *fragments)


def test_unclosed_call_parenthesis():
    src = HEAD + "state S[dk, dv]\nS = S + outer(k, v\noutput o = q·S\n"
    col_open = where(src, 4, "(")[1]
    check(compile_error(src), src, end_of(src, 4), "unexpected end of line",
          f"the '(' at column {col_open} is never closed")


def test_unclosed_parenthesis_at_end_of_file():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = (q·S"  # no final newline
    col_open = where(src, 5, "(")[1]
    check(compile_error(src), src, end_of(src, 5), "expected ')'", f"the '(' at column {col_open} is never closed")


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x0c", "\x0b", "\x1c", "\x85"])
def test_hints_count_lines_as_the_parser_does(separator):
    """A comment holding a character str.splitlines() breaks at (not the parser) leaves the hints on the line
    the error names: the unclosed bracket's and the missing shape's."""
    src = f"# a comment {separator} with a line separator\n" + HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = (q·S\n"
    col_open = where(src, 6, "(")[1]
    check(compile_error(src), src, end_of(src, 6), "expected ')'", f"the '(' at column {col_open} is never closed")
    src = f"# a comment {separator} with a line separator\n" + HEAD + "state S[dk, dv], c\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, end_of(src, 4), "expected '['", "a state has a shape")


def test_unclosed_parenthesis_over_continued_lines():
    src = HEAD + "state S[dk, dv]\nS = S + (k⊗v \\\n  + k⊗v\noutput o = q·S\n"
    col_open = where(src, 4, "(")[1]
    check(compile_error(src), src, end_of(src, 5), f"the '(' at line 4, column {col_open} is never closed")


def test_unclosed_bracket_in_shape():
    src = HEAD + "state S[dk, dv\nS = S + k⊗v\noutput o = q·S\n"
    col_open = where(src, 3, "[")[1]
    check(compile_error(src), src, end_of(src, 3), "expected", "']'", f"the '[' at column {col_open} is never closed")


def test_unexpected_character_with_hint():
    src = HEAD + "state S[dk, dv]\nS = S + k×v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "×"), "unexpected character '×'", "write '*'", width=1)


@pytest.mark.parametrize("text, bad, hint", [
    ("S = S + k∙v", "∙", "write '·' or '@' for a contraction"),
    ("S = S + k•v", "•", "write '·' or '@' for a contraction"),
    ("S = S – k⊗v", "–", "a dash: write '−' or '-' for a minus"),
    ("S = S + dk^(‐1)·k⊗v", "‐", "a dash: write '−' or '-' for a minus"),
    ("S = S + k⊗(v⊙v)", "⊙", "write '*' for an elementwise product"),  # (a probe's: these said nothing more)
    ("S = S + k⊗v/‖k‖", "‖", "write norm(x) for ‖x‖"),
])
def test_look_alike_characters_name_the_one_to_write(text, bad, hint):
    src = HEAD + f"state S[dk, dv]\n{text}\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, bad), f"unexpected character '{bad}'", hint, width=1)


def test_a_fraction_character_is_a_name_to_the_lexer_and_says_so():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = dk^(−½)·q·S\n"
    check(compile_error(src), src, where(src, 5, "½"), "unknown name '½'", "write a fraction as a division, e.g. (1/2)")


def test_a_transpose_says_there_is_none_and_what_to_write():
    """`k·vᵀ` from a paper: 'vᵀ' is a name to the lexer, and was an unknown one with no more said (a probe's)."""
    src = HEAD + "state S[dk, dv]\nS = S + k·vᵀ\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "vᵀ"), "unknown name 'vᵀ'", "there is no transpose",
          "write k⊗v for the outer product k·vᵀ")


@pytest.mark.parametrize("decay, matrix", [("exp(X)*S", "X"), ("exp(A·diag(dt))*S", "A")])
def test_a_state_read_from_the_right_that_meets_a_matrix_says_how_to_turn_it(decay, matrix):
    """An elementwise decay by an input or param matrix of a state read from the right (Mamba-1 written in the
    transposed convention): carried transposed, the matrix would be transposed too. The reason said only that
    the output read the state other than through `q·S` (a probe's finding); it says what stops the transpose
    and how to write the program so that it has the forms — which that program then has."""
    decls = "input q[dk], k[dk], v[dv], X[dv, dk] <= 0, dt[dk] > 0\nparam A[dv, dk] = −uniform(0.5, 2, seed=0)\n"
    rec = linrec.compile(f"recurrence t(dk = 4, dv = 3)\n{decls}state S[dv, dk]\nS = {decay} + v⊗k\n"
                         f"output o = S·q\n", "t.lin")
    why = rec.decomposition.why_not("parallel")
    assert why is not None and f"its update meets '{matrix}'" in why and "declare 'S' with its axes swapped" in why
    turned = decay.replace("A·diag(dt)", "diag(dt)·A")  # (A [dk, dv] now: each row scaled by its dt)
    rec = linrec.compile(f"recurrence t(dk = 4, dv = 3)\n{decls.replace('[dv, dk]', '[dk, dv]')}state S[dk, dv]\n"
                         f"S = {turned} + k⊗v\noutput o = q·S\n", "t.lin")
    assert rec.forms == ("recurrent", "parallel", "chunkwise")


def test_a_dot_meant_as_a_decay_of_the_rows_says_diag():
    """`sigmoid(a)·S + k⊗v`: the dot is a readout, a vector, and the sum's shapes differ — where `*` says
    diag(v)·M, this said only the shapes (a probe's finding)."""
    src = HEAD.replace("v[dv]", "v[dv], a[dk]") + "state S[dk, dv]\nS = sigmoid(a)·S + k⊗v\noutput o = q·S\n"
    err = compile_error(src)
    assert "shape mismatch in '+'" in str(err) and "to scale M's rows by v, write diag(v)·M" in str(err)


def test_a_byte_order_mark_is_no_character():
    rec = linrec.compile("\ufeff" + HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n")
    assert rec.name == "t" and not rec.compiled.source.startswith("\ufeff")


@pytest.mark.parametrize("invisible", ["\ufeff", "\u200b"])
def test_an_invisible_character_inside_the_file_says_to_delete_it(invisible):
    """A byte-order mark past the file's start (two files pasted together) or a zero-width space: named."""
    src = HEAD + f"state S[dk, dv]\nS = S + k⊗v\n{invisible}output o = q·S\n"
    check(compile_error(src), src, (5, 1), "unexpected character", "an invisible character", "delete it", width=1)


@pytest.mark.parametrize("last", ["output o = q·S \\", "output o = q·S + \\"])
def test_a_continuation_at_the_end_of_the_file_says_so(last):
    """A last line ending in a backslash was 'unexpected end of line; expected end of line, …'."""
    src = HEAD + f"state S[dk, dv]\nS = S + k⊗v\n{last}\n"
    err = compile_error(src)
    assert "unexpected end of file" in str(err) and "the line ends in '\\'" in str(err), str(err)
    assert err.span.line == 5, str(err)


def test_a_file_that_is_not_utf8_is_refused_at_its_first_such_byte(tmp_path):
    path = tmp_path / "latin.lin"
    path.write_bytes((HEAD + "state S[dk, dv]\nS = S + k⊗v  # café\noutput o = q·S\n").encode("utf-8")
                     .replace("é".encode("utf-8"), b"\xe9"))
    with pytest.raises(LinrecError) as info:
        linrec.load(path)
    err = info.value
    assert (err.span.line, err.span.column) == (4, len("S = S + k⊗v  # caf") + 1), str(err)
    assert "byte 0xe9 is not UTF-8" in str(err) and "save it as UTF-8" in str(err), str(err)
    assert str(err).splitlines()[1] == "  S = S + k⊗v  # caf\ufffd"


def test_a_long_line_is_quoted_around_its_place():
    """A generated program with thousands of characters on a line: the error quotes EXCERPT of them around
    the caret (it quoted the whole line: 27 KB for one error)."""
    from linrec.dsl.errors import EXCERPT
    terms = " + ".join(f"x{i}" for i in range(3000))
    src = HEAD + f"state S[dk, dv]\nS = S + k⊗v\noutput o = q·S + {terms}\n"
    line, caret = str(compile_error(src)).splitlines()[1:3]
    assert len(line) <= EXCERPT + 4 and line.endswith("…") and len(caret) <= len(line), (line, caret)
    far = LinrecError("here", linrec.dsl.errors.Span(1, 20001, 1, 20004), source="y" * 20000 + "abc" + "z" * 9000)
    line, caret = str(far).splitlines()[1:3]
    assert line.startswith("  …") and line.endswith("…") and len(line) <= EXCERPT + 4, line
    assert line[caret.index("^"):caret.index("^") + 3] == "abc" and caret.count("^") == 3, (line, caret)


def test_unexpected_character_dollar():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v $\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "$"), "unexpected character '$'")


def test_a_function_that_calls_itself():
    src = HEAD + "f(x) = f(x) + 1\nstate S[dk, dv]\nS = S + f(k)⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "f(x) + 1"), "function 'f' calls itself; recursion is not supported",
          width=4)


def test_functions_that_call_each_other_name_the_cycle():
    """The error points into the last function of the cycle, so it says which functions lead back there."""
    src = HEAD + "f(x) = g(x) + 1\ng(x) = m(x)*2\nm(x) = f(x)\nstate S[dk, dv]\nS = S + f(k)⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 5, "f(x)"), "function 'f' calls itself through f → g → m → f",
          "recursion is not supported", width=4)


def test_an_outer_product_with_a_scalar_side_says_how_the_operators_bind():
    src = HEAD + "input s\nstate S[dk, dv]\nS = S + k⊗s·v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 5, "k⊗s"), "'⊗' takes two vectors, got [dk] and scalar",
          "`k⊗s·v` is `(k⊗s)·v`", "`k⊗(s·v)`", width=3)
    src = HEAD + "state S[dk, dv]\nS = S + (k⊗v)⊗v\noutput o = q·S\n"  # (a matrix: no such hint)
    assert "bind equally" not in str(compile_error(src))


def test_two_statements_on_one_line():
    src = HEAD + "state S[dk, dv] S = S\n"
    check(compile_error(src), src, where(src, 3, "S", 2), "unexpected 'S'", "each statement goes on its own line")


def test_missing_header():
    src = "input q[dk]\nstate S[dk]\n"
    check(compile_error(src), src, (1, 1), "a program starts with its header", "recurrence NAME(",
          "found 'input'", width=5)


@pytest.mark.parametrize("src", ["", "   \n", "\n\n   \n# only a comment\n", "# a comment\n  # another, no newline"])
def test_empty_program(src):
    """No statement — nothing, whitespace, or comments only (the parser stopped at a comment's end of line:
    'unexpected end of line' before) — is an empty program, with where to start."""
    err = compile_error(src)
    assert err.span is not None and (err.span.line, err.span.column) == (1, 1)
    assert str(err).startswith(f"{FILE}:1:1: error: empty program: start with `recurrence NAME(dk = 64, dv = 64)`")


def test_incomplete_expression():
    src = HEAD + "state S[dk, dv]\nS = S +\noutput o = q·S\n"
    check(compile_error(src), src, end_of(src, 4), "unexpected end of line", "a name")


def test_positional_after_keyword():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = l2norm(q, eps=1e-3, 2)·S\n"
    check(compile_error(src), src, where(src, 5, "2)"), "positional argument cannot follow a keyword")


def test_empty_interval():
    src = "recurrence t(dk = 4)\ninput q[dk], beta in (1, 0)\nstate S[dk]\nS = S + q\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 2, "in ("), "empty interval", "lower end 1", "upper end 0")


# (found by probing: a keyword as a name, and `per` without `head` on its line, were "unexpected character 'p'")
@pytest.mark.parametrize("line, word", [
    ("input per", "per"), ("per = 2*q", "per"), ("x = 2*per", "per"), ("input in", "in"),
    ("x = causal", "causal"), ("input state", "state"),
])
def test_a_keyword_used_as_a_name_says_it_is_a_keyword(line, word):
    src = HEAD + f"{line}\nstate S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n"
    at = (3, line.rindex(word) + 1) if line.endswith(word) else where(src, 3, word)
    check(compile_error(src), src, at, f"'{word}' is a keyword", "cannot be a name",
          f"choose another name, e.g. '{word}_'", width=len(word))


@pytest.mark.parametrize("declaration, follows", [
    ("param w per\n  head", "the end of the line"), ("param w per", "the end of the line"),
    ("param w per heads", "'heads'"), ("param w per-head", "'-'"),
])
def test_per_without_head_on_its_line_says_per_head_is_one_keyword(declaration, follows):
    src = HEAD + f"{declaration}\nstate S[dk, dv]\nS = S + k⊗v\noutput o = w*q·S\n"
    check(compile_error(src), src, where(src, 3, "per"), f"'per' is followed here by {follows}",
          "the keyword 'per head'", "`param NAME per head`", "write 'head' after it on the same line", width=3)


@pytest.mark.parametrize("declaration, token", [
    ("param w per head in (0, 1)", "in"), ("param w <= 1", "<="), ("param w[dk] ≥ 0 = 1", "≥"),
])
def test_a_range_on_a_param_says_ranges_are_for_inputs(declaration, token):
    """A range after a param's name was refused with only the tokens the parser could take there."""
    src = HEAD + f"{declaration}\nstate S[dk, dv]\nS = S + k⊗v\noutput o = w*q·S\n"
    check(compile_error(src), src, where(src, 3, token), f"unexpected '{token}'", "a param declares no range",
          "ranges are for inputs", "`gamma = sigmoid(a)`", width=len(token))


def test_per_head_may_be_continued_over_a_line_end():
    """A line ending in '\\' continues the statement, between the words of `per head` too (it was refused)."""
    src = HEAD + "param w per \\\n  head = 1\nstate S[dk, dv]\nS = S + k⊗v\noutput o = w*q·S\n"
    assert linrec.compile(src, FILE).compiled.program.params[0].per_head


def test_a_second_header_says_one_recurrence_per_file():
    """It said "('recurrence' starts a statement of its own line)", on a line of its own."""
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S\nrecurrence u(dk = 4)\n"
    check(compile_error(src), src, (6, 1), "a file holds one recurrence", "a file of its own", width=10)


def test_an_exponent_with_a_dash_says_how_exponents_are_written():
    src = HEAD + "x = 1e–3*q\nstate S[dk, dv]\nS = S + k⊗v\noutput o = x·S\n"
    check(compile_error(src), src, where(src, 3, "e"), "unexpected 'e'", "written as in 1e-3 or 1e−3", width=1)


def test_a_number_glued_to_a_name_says_to_write_the_product():
    """Found by probing: `x = 2x` said only what may come after the 2."""
    src = HEAD + "x = 2k\nstate S[dk, dv]\nS = S + x⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "k"), "unexpected 'k'", "written with an operator: 2*k or 2·k",
          width=1)


def test_a_line_of_spaces_or_an_indented_comment_is_no_statement():
    """Found by probing: a blank line holding spaces, or a comment indented, was "unexpected end of line"."""
    src = HEAD + "  \n    # an indented comment\nstate S[dk, dv]\n\t\nS = S + k⊗v   \n  \noutput o = q·S\n   \n"
    assert linrec.compile(src, FILE).name == "t"


def test_the_names_keywords_are_the_grammars():
    """Every word the grammar keeps from names has a use the keyword message can name."""
    from linrec.dsl.parser import KEYWORDS, _parser
    name = next(t for t in _parser().terminals if t.name == "NAME").pattern.value
    assert set(re.search(r"\(\?!\(([^)]*)\)", name).group(1).split("|")) == set(KEYWORDS)


@pytest.mark.parametrize("number, value", [("1e−3", 1e-3), ("2.5E−2", 2.5e-2), ("1e-3", 1e-3)])
def test_an_exponent_takes_the_minus_sign_as_expressions_do(number, value):
    """`1e−3` with U+2212, the minus the DSL takes in `dk^(−1/2)`, is 1e-3 (it was "unexpected 'e'")."""
    src = f"recurrence t(dk = 4)\ninput q[dk], beta in (−{number}, 1)\nparam c = {number}\nstate S[dk]\n" \
          f"S = S + beta*q\noutput o = c*q·S\n"
    program = linrec.dsl.parse(src)
    assert program.statements[0].constraint is None and program.statements[1].constraint.low == -value
    assert program.statements[2].default.value == value
    linrec.compile(src, FILE)


def _internal_terminal_names() -> set[str]:
    """How the old messages leaked the grammar's terminals: a name in lower case ('rbracket'), where it is no
    text the user writes (a keyword's name is its text: 'input')."""
    from lark.lexer import PatternStr
    from linrec.dsl.parser import _parser
    return {repr(t.name.lower()) for t in _parser().terminals
            if not (isinstance(t.pattern, PatternStr) and t.pattern.value == t.name.lower())}


def test_every_terminal_has_a_readable_name():
    """A terminal of a pattern needs a description in the table (one without is left out of messages)."""
    from linrec.dsl.parser import _parser, _readable
    parser = _parser()
    for t in parser.terminals:
        if t.name not in parser.ignore_tokens:
            assert _readable(t.name) and _readable(t.name) not in _internal_terminal_names(), t.name


def test_expected_tokens_are_written_as_the_user_writes_them():
    """An interval's closing bracket was listed as 'rbracket', and ',' with it, which cannot come there."""
    src = "recurrence t(dk = 4)\ninput q[dk], beta in (0, 1 x\nstate S[dk]\nS = S + beta*q\noutput o = q·S\n"
    err = compile_error(src)
    check(err, src, where(src, 2, "x"), "unexpected 'x'; expected ')' or ']'", width=1)
    assert "rbracket" not in str(err) and "','" not in str(err), str(err)


def test_expected_tokens_are_those_that_can_come_there():
    """Lark's expected set is a row of its LALR table: ',' and end of line inside parentheses, where neither
    can come; and after a token that made it reduce first, too few (`x = q )` listed only end of line)."""
    src = HEAD + "x = (q k\nstate S[dk, dv]\nS = S + k⊗v\noutput o = x·S\n"
    err = compile_error(src)
    check(err, src, where(src, 3, "k"), "unexpected 'k'; expected ')', ", width=1)
    assert "','" not in str(err) and "end of line" not in str(err), str(err)
    src = HEAD + "x = q )\nstate S[dk, dv]\nS = S + k⊗v\noutput o = x·S\n"
    check(compile_error(src), src, where(src, 3, ")"), "unexpected ')'; expected end of line, ", "'*'", "'·'",
          width=1)


def test_no_message_names_an_internal_terminal():
    """Every prefix of an example, and the example with a stray bracket or comma at every place: no message
    names a terminal by its grammar name."""
    text = (EXAMPLES / "deltanet.lin").read_text(encoding="utf-8")
    internal = _internal_terminal_names()
    variants = [text[:i] for i in range(len(text))]
    variants += [text[:i] + extra + text[i:] for i in range(len(text)) for extra in (")", "]", ",")]
    for variant in variants:
        try:
            linrec.dsl.parse(variant, FILE)
        except LinrecError as err:
            message = str(err).splitlines()[0]
            assert not any(name in message for name in internal), (variant, message)


# ---- names ---------------------------------------------------------------------------------------
def test_unknown_name_did_you_mean():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗vv\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "vv"), "unknown name 'vv'; did you mean 'v'?", width=2)


def test_unknown_name_did_you_mean_state():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·SS\n"
    check(compile_error(src), src, where(src, 5, "SS"), "unknown name 'SS'; did you mean 'S'?", width=2)


def test_unknown_name_without_close_match():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗zzzzz\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "zzzzz"), "unknown name 'zzzzz'", "declare it", width=5)


def test_unknown_function_did_you_mean():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = l2nrom(q)·S\n"
    check(compile_error(src), src, where(src, 5, "l2nrom"), "unknown function 'l2nrom'; did you mean 'l2norm'?",
          width=6)


def test_unknown_function_without_close_match():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = qq(q)·S\n"
    check(compile_error(src), src, where(src, 5, "qq"), "unknown function 'qq'", "define it first", width=2)


def test_unknown_name_in_function_body_even_if_unused():
    src = HEAD + "phi(x) = elu(xx) + 1\nstate S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "xx"), "unknown name 'xx' in the body of 'phi'",
          "did you mean 'x'?", width=2)


def test_unknown_function_in_function_body_even_if_unused():
    src = HEAD + "phi(x) = psi(x) + 1\nstate S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "psi"), "unknown function 'psi'", width=3)


def test_function_body_may_use_names_defined_later():
    src = HEAD + "f(x) = x·S\nstate S[dk, dv]\nS = S + k⊗v\noutput o = f(q)\n"
    rec = linrec.compile(src, FILE)
    x = rec.random_inputs(batch=1, tokens=3, heads=1, seed=0)
    res = rec.run(x)
    S = np.cumsum(np.einsum("bthi,bthj->bthij", x["k"], x["v"]), axis=1)
    np.testing.assert_allclose(res.outputs["o"], np.einsum("bthi,bthij->bthj", x["q"], S), rtol=1e-12)


@pytest.mark.parametrize("use", ["output o = I(q)·S", "f(x) = I(x)·x\noutput o = f(q)·S"])
def test_calling_the_identity_says_what_it_is(use):
    """`I(q)` said "unknown function 'I'; define it first", but defining I is refused."""
    src = HEAD + f"state S[dk, dv]\nS = S + k⊗v\n{use}\n"
    check(compile_error(src), src, where(src, 5, "I("), "'I' is the identity matrix, not a function",
          "use it in a product", "`(I − beta·k⊗k)·S`", width=1)


def test_calling_the_head_index_says_what_it_is():
    src = HEAD + "param w per head = h(2)\nstate S[dk, dv]\nS = S + k⊗v\noutput o = w*q·S\n"
    check(compile_error(src), src, where(src, 3, "h("), "'h' is the head index, a number, not a function",
          width=1)


@pytest.mark.parametrize("early, late, name, what", [
    ("x = 2*q", "input q[dk], k[dk], v[dv]", "q", "an input"),
    ("x = w*k", "param w = 2", "w", "a parameter"),
    ("x = phi(k)", "phi(y) = 2*y", "phi", "a function"),
])
def test_a_name_used_before_its_declaration_says_where_it_is_declared(early, late, name, what):
    """An input read on a line above its `input` line was "unknown name 'q'" (with a "did you mean" for
    another name)."""
    inputs = "" if late.startswith("input") else "input q[dk], k[dk], v[dv]\n"
    src = f"recurrence t(dk = 4, dv = 3)\n{inputs}{early}\n{late}\nstate S[dk, dv]\nS = S + k⊗v\noutput o = x·S\n"
    line = src.splitlines().index(early) + 1
    check(compile_error(src), src, where(src, line, name), f"'{name}' is used before its declaration",
          f"it is {what} declared later, on line {line + 1}", f"move that declaration above its first use (line "
          f"{line})", width=len(name))


def test_a_value_read_in_its_own_definition_says_so():
    src = HEAD + "x = 2*x\nstate S[dk, dv]\nS = S + k⊗v\noutput o = x·S\n"
    check(compile_error(src), src, where(src, 3, "x", 2), "'x' is defined here from itself", width=1)


def test_an_output_read_before_its_line_says_outputs_cannot_be_read():
    src = HEAD + "x = 2*o\nstate S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "o"), "'o' is an output (line 6) and cannot be read", width=1)


def test_a_param_default_reading_an_input_declared_later_says_it_cannot():
    src = "recurrence t(dk = 4, dv = 3)\nparam w = 2*q\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n" \
          "S = S + k⊗v\noutput o = w*q·S\n"
    check(compile_error(src), src, where(src, 2, "q"), "a parameter's default may use only", "not 'q'", width=1)


def test_redefined_input():
    src = HEAD + "input k[dk]\nstate S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "k"), "'k' is already defined (line 2)", width=1)


def test_redefined_value():
    src = HEAD + "state S[dk, dv]\na = q\na = k\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, (5, 1), "'a' is already defined (line 4)")


def test_redefined_state_in_one_declaration():
    src = HEAD + "state S[dk, dv], S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "S", 2), "'S' is already defined (line 3)")


def test_redefined_function():
    src = HEAD + "f(x) = x\nf(y) = y\nstate S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, (4, 1), "'f' is already defined (line 3)")


def test_redefined_output():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S\noutput o = k·S\n"
    check(compile_error(src), src, where(src, 6, "o ="), "'o' is already defined (line 5)", width=1)


def test_state_in_steps_around_another_update():
    # S's steps are composed at its last assignment, where z already holds its new value
    src = HEAD + "state S[dk, dv], z[dk]\nS = S + (z*k)⊗v\nz = z + k\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, (6, 1), "an earlier assignment of 'S' reads 'z' before its update (line 5)",
          "update 'z' before the first assignment of 'S' or after its last")
    src = HEAD + "state S[dk, dv], z[dk]\nS = S + (z*k)⊗v\nz = z + k\noutput p = q·S\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, (6, 8), "this reads 'S' between two of its assignments, and that value reads "
          "'z' before its update (line 5)", "one update at its last (line 7)")


def test_noncausal_output_between_steps():
    src = HEAD.replace("dv = 3)", "dv = 3) noncausal") + "state S[dk, dv]\nS = S + k⊗v\noutput p = q·S\n" \
        "S = 0.5·S\noutput o = q·S\n"
    check(compile_error(src), src, (5, 8), "a non-causal program's outputs read each state after every token")


def test_assigning_an_input():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\nq = k\noutput o = q·S\n"
    check(compile_error(src), src, (5, 1), "'q' is an input, parameter or dimension and cannot be assigned")


def test_builtin_name_cannot_be_declared():
    src = HEAD + "state exp[dk, dv]\nexp = exp + k⊗v\noutput o = q·exp\n"
    check(compile_error(src), src, where(src, 3, "exp"), "'exp' is a builtin name", width=3)


def test_dimension_declared_twice():
    src = "recurrence t(dk = 4, dk = 3)\ninput q[dk]\nstate S[dk]\nS = S + q\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 1, "dk", 2), "dimension 'dk' is declared twice", width=2)


@pytest.mark.parametrize("size", [2**31, 10**10, 99999999999999999999])
def test_a_dimension_above_the_size_limit(size):
    """A header's size above 2³¹ − 1 passed `linrec check`, and emitted C looped to it in an int."""
    src = f"recurrence t(dk = {size}, dv = 3)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\nS = S + k⊗v\n" \
          "output o = q·S\n"
    check(compile_error(src), src, where(src, 1, "dk"), f"dimension 'dk' = {size} is too large",
          "sizes go up to 2147483647", "make it smaller", width=2)
    linrec.compile(src.replace(str(size), str(2**31 - 1)), FILE)  # (the limit itself is a size)


def test_dims_above_the_size_limit_are_refused_at_call_time():
    """dims= above 2³¹ − 1 reached NumPy's shapes (ValueError) or C's ints; it is the caller's error."""
    rec = linrec.compile(HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n", FILE)
    x = rec.random_inputs(1, 2, 1)
    message = "dimension dv = 2147483648 is too large: sizes go up to 2147483647"
    for call in (lambda: rec.random_inputs(1, 2, 1, dims={"dv": 2**31}), lambda: rec.default_params(1, {"dv": 2**31}),
                 lambda: rec.run(x, dims={"dv": 2**31}), lambda: rec.choose_form("numpy", 4, dims={"dv": 2**31})):
        with pytest.raises(RuntimeInputError, match=message):
            call()


@pytest.mark.parametrize("call, message", [
    (dict(tokens=-1), "tokens must be a whole number ≥ 1 (an int), got -1"),
    (dict(tokens=2.5), "tokens must be a whole number ≥ 1 (an int), got 2.5"),
    (dict(batch=0), "batch must be a whole number ≥ 1 (an int), got 0"),
    (dict(heads=True), "heads must be a whole number ≥ 1 (an int), got True"),
    (dict(heads=2**31), "heads = 2147483648 is too large: sizes go up to 2147483647"),
    (dict(dtype=np.float16), "dtype float16: the inputs run takes are float32 or float64"),
    (dict(dtype=np.int64), "dtype int64: the inputs run takes are float32 or float64"),
    (dict(dtype="nope"), "dtype 'nope' is not a NumPy dtype; pass float32 or float64"),
    (dict(dims={"zz": 1}), "'t' has no dimension 'zz'; its dimensions are dk, dv"),
])
def test_random_inputs_checks_what_run_checks(call, message):
    """random_inputs(2, -1, 3) was NumPy's ValueError, tokens=2.5 a TypeError; float16 or int64 arrays, which
    run refuses, came back, and an unknown dimension was ignored where run refuses it."""
    rec = linrec.compile(HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n", FILE)
    with pytest.raises(RuntimeInputError) as info:
        rec.random_inputs(**{"batch": 1, "tokens": 2, "heads": 1} | call)
    assert str(info.value).startswith(f"error: {message}"), str(info.value)
    x = rec.random_inputs(np.int64(1), 2, 1, dims={"dk": np.int32(5)}, dtype=np.float32)
    assert x["q"].shape == (1, 2, 1, 5) and x["q"].dtype == np.float32
    with pytest.raises(RuntimeInputError, match="every size must be at least 1"):  # (run refuses B, T, H of 0 too)
        rec.run({name: value[:, :0] for name, value in x.items()})


def test_reading_an_output():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S\noutput p = sum(o)\n"
    check(compile_error(src), src, where(src, 6, "o)"), "'o' is an output and cannot be read")


def test_head_index_outside_param():
    src = HEAD + "state S[dk, dv]\nS = S + h*k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "h"), "head index 'h'", width=1)


def test_head_count_outside_a_param_default():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v/H\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "H"), "the number of heads 'H' may only appear in a parameter's "
          "default", width=1)


def test_head_count_in_param_defaults():
    """`H`, the call's number of heads, in param defaults (it was an unknown name: a probe's finding): every form
    on both backends at two head counts, and a dim named H is the program's."""
    rec = linrec.compile(HEAD + "param lam per head = exp(−8*(h + 1)/H)\nparam scale = 1/H\nstate S[dk, dv]\n"
                         "S = lam·S + k⊗v\noutput o = scale·q·S\n", "heads.lin")
    for heads in (2, 4):
        x = rec.random_inputs(1, 5, heads, seed=heads)
        reference = rec.run(x)
        np.testing.assert_allclose(reference.params["lam"], np.exp(-8 * (np.arange(heads) + 1) / heads), rtol=1e-15)
        assert reference.params["scale"] == 1 / heads
        for backend in ("numpy", "c"):
            for form in rec.forms:
                got = rec.run(x, form=form, backend=backend).outputs["o"]
                np.testing.assert_allclose(got, reference.outputs["o"], rtol=1e-12, err_msg=f"{form} {backend}")
    own = linrec.compile("recurrence t(dk = 4, H = 3)\ninput q[dk], k[dk], v[H]\nstate S[dk, H]\n"
                         "S = S + k⊗v\noutput o = q·S\n", "own.lin")
    assert [d.name for d in own.program.dims] == ["dk", "H"]


def test_max_and_min_are_elementwise_on_every_form():
    """max(a, b) and min(a, b), which were unknown functions (mLSTM's max(|n·q|, 1) had to be written with relu: a
    probe's finding): against np.maximum and np.minimum on every form and both backends, and their errors."""
    rec = linrec.compile(HEAD + "input c\nstate S[dk, dv]\nS = S + k⊗v\noutput o = max(q·S, c)\n"
                         "output p = min(k, 0.25) + max(0, q)\n", "minmax.lin")
    x = rec.random_inputs(2, 9, 2, seed=3)
    S = np.cumsum(np.einsum("bthk,bthv->bthkv", x["k"], x["v"]), axis=1)
    want_o = np.maximum(np.einsum("bthk,bthkv->bthv", x["q"], S), x["c"][..., None])
    want_p = np.minimum(x["k"], 0.25) + np.maximum(0, x["q"])
    for backend in ("numpy", "c"):
        for form in rec.forms:
            got = rec.run(x, form=form, backend=backend).outputs
            np.testing.assert_allclose(got["o"], want_o, rtol=1e-12, atol=1e-12, err_msg=f"{form} {backend}")
            # (b + relu(a − b) rounds a − b: within an ulp of the larger operand, here below 4)
            np.testing.assert_allclose(got["p"], want_p, rtol=0, atol=4e-15, err_msg=f"{form} {backend}")
    for call, message in (("max(q)", "'max' takes two arguments"), ("min(q, v)", "two values of one shape")):
        src = HEAD + f"state S[dk, dv]\nS = S + k⊗v\noutput o = q·S\noutput p = {call}\n"
        assert message in str(compile_error(src))


@pytest.mark.parametrize("decay, value", [("min(a, 0.9)", lambda a: np.minimum(a, 0.9)),
                                          ("max(a, 0.2)", lambda a: np.maximum(a, 0.2))])
def test_a_decay_of_max_or_min_is_bounded_by_its_operands(decay, value):
    """min(a, 0.9) with a in (0, 1): its bounds were taken term by term from a − relu(a − 0.9), each a on its
    own, (−0.1, 1), and the decay was refused the forms (a probe's finding). They are the smaller operand's:
    (0, 0.9]. Every form on both backends against the loop."""
    rec = linrec.compile(f"recurrence t(dk = 4, dv = 3)\ninput q[dk], k[dk], v[dv], a in (0, 1)\nstate S[dk, dv]\n"
                         f"S = {decay}·S + k⊗v\noutput o = q·S\n", "decay.lin")
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    x = rec.random_inputs(1, 9, 2, seed=4)
    want, S = np.zeros((1, 9, 2, 3)), np.zeros((1, 2, 4, 3))
    for t in range(9):
        S = value(x["a"][:, t])[..., None, None] * S + np.einsum("bhk,bhv->bhkv", x["k"][:, t], x["v"][:, t])
        want[:, t] = np.einsum("bhk,bhkv->bhv", x["q"][:, t], S)
    for backend in ("numpy", "c"):
        for form in rec.forms:
            got = rec.run(x, form=form, backend=backend, chunk_size=4).outputs["o"]
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13, err_msg=f"{form} {backend}")


def test_head_index_in_param_not_per_head():
    src = HEAD + "param u = 1 + h\nstate S[dk, dv]\nS = S + u*k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "1 + h"), "'u' uses the head index h", "param u per head")


def test_param_default_reads_an_input():
    src = HEAD + "param w = q\nstate S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "q"), "a parameter's default may use only", "not 'q'")


def test_random_outside_param():
    src = HEAD + "state S[dk, dv]\nS = S + randn(seed=1)*k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "randn"), "'randn' draws random numbers")


def test_wrong_number_of_arguments():
    src = HEAD + "f(x) = x\nstate S[dk, dv]\nS = S + f(k, v)⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 5, "f(k, v)"), "'f' takes 1 argument(s) (x), got 2", width=7)


def test_unknown_option():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = l2norm(q, tol=1)·S\n"
    check(compile_error(src), src, where(src, 5, "l2norm"), "'l2norm' has no option 'tol' (options: eps)")



@pytest.mark.parametrize("seed", ["-2", "2.5"])
def test_seed_must_be_a_whole_number(seed):
    """(was: an internal error from NumPy's generator for a negative seed, and 2.5 taken as 2 silently)"""
    src = HEAD + f"param W[dk, dk] = randn(seed={seed})\nstate S[dk, dv]\nS = S + (W·k)⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, seed), "option 'seed' must be a whole number ≥ 0")


@pytest.mark.parametrize("default, fragment, message", [
    ("randn(std=-1)", "randn", "randn's std must be ≥ 0"),
    ("uniform(3, 1)", "uniform", "uniform's low (3) is above its high (1)"),
    ("random_features(orthogonal=0.5)", "0.5", "option 'orthogonal' is 0 (i.i.d. rows) or 1"),
])
def test_random_defaults_with_impossible_options(default, fragment, message):
    """(were: NumPy's errors as internal errors, or orthogonal=0.5 taken as 1 silently)"""
    src = HEAD + f"param W[dk, dk] = {default}\nstate S[dk, dv]\nS = S + (W·k)⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, fragment), message)


def test_random_features_needs_a_matrix_param():
    """(was: `check` passed and `run` an internal error, NumPy's 'not enough values to unpack')"""
    src = HEAD + "param w[dk] = random_features(seed=3)\nstate S[dk, dv]\nS = S + (w*k)⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "random_features"), "random_features draws the rows of a "
          "projection matrix, but this param has shape [dk]", "e.g. `param W[m, dk] = random_features(seed=0)`")


@pytest.mark.parametrize("call", ["l2norm(q, eps=-1)", "groupnorm(q, eps=-0.5)", "rmsnorm(q, eps=-1e-6)"])
def test_negative_eps_is_refused(call):
    """eps goes under a square root: a negative one gave NaN outputs with a NumPy warning only."""
    src = HEAD + f"state S[dk, dv]\nS = S + k⊗v\noutput o = {call}·S\n"
    check(compile_error(src), src, where(src, 5, "-"), "option 'eps' must be ≥ 0")


def test_lsh_attention_takes_vector_values():
    """(was: a NumPy broadcast error from the parallel form, as an internal error)"""
    src = "recurrence r(dk = 4)\ninput q[dk], v\noutput o = lsh_attention(q, v, buckets=2)\n"
    check(compile_error(src), src, where(src, 3, "v,"), "lsh_attention averages vectors of values, got a scalar")

# ---- shapes --------------------------------------------------------------------------------------
def test_shape_mismatch_delta_rule_on_the_wrong_side():
    src = HEAD + "input beta in (0, 1)\nstate S[dk, dv]\nS = S·(I − beta·k⊗k) + k⊗v\noutput o = q·S\n"
    err = compile_error(src)
    check(err, src, where(src, 5, "S·("), "shape mismatch in '·'", "[dk, dv]·[dk, dk]",
          "contracts 'dv' with 'dk'", width=len("S·(I − beta·k⊗k)"))


def test_shape_mismatch_in_sum():
    src = HEAD + "state S[dk, dv]\nS = S + v⊗k\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "S +"), "shape mismatch in '+': [dk, dv] and [dv, dk]",
          width=len("S + v⊗k"))


def test_shape_mismatch_in_output():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S + k\n"
    check(compile_error(src), src, where(src, 5, "q·S"), "shape mismatch in '+': [dv] and [dk]")


def test_update_with_the_wrong_shape():
    src = HEAD + "state S[dk, dv]\nS = (q·S)⊗(q·S)\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "(q·S)"),
          "the update of 'S' has shape [dv, dv] but the state is declared [dk, dv]")


def test_matrix_output():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = S\n"
    check(compile_error(src), src, where(src, 5, "S"), "output 'o' has shape [dk, dv]")


def test_state_of_rank_three():
    src = HEAD + "state S[dk, dv, dk]\nS = S\noutput o = q\n"
    check(compile_error(src), src, where(src, 3, "S"), "must be a vector or a matrix")


def test_unknown_dimension_in_state():
    src = HEAD + "state S[dk, de]\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "S"), "unknown dimension 'de' (declared: dk, dv)",
          "recurrence t(…, de = 64)")


def test_unknown_dimension_in_input():
    src = HEAD + "input w[dz]\nstate S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "w"), "unknown dimension 'dz'")


# ---- linearity -----------------------------------------------------------------------------------
def test_update_quadratic_in_state_matrix_product():
    src = SQUARE_HEAD + "state S[dk, dk]\nS = S·S\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "S·S"), "the update is not linear in 'S'",
          "multiplies the state by itself", width=3)


def test_update_quadratic_in_state_elementwise():
    src = HEAD + "state S[dk, dv]\nS = S*S\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "S*S"), "not linear in 'S'", width=3)


@pytest.mark.parametrize("update", ["V = k⊗k*V + V*V", "V = V*V + k⊗k*V"])
def test_linearity_does_not_depend_on_the_order_of_terms(update):
    """k⊗k*V is linear but not a product the derived forms factor; checking linearity used to stop there,
    so a square of the state after it was accepted (before it, rejected)."""
    src = SQUARE_HEAD + f"state V[dk, dk]\n{update}\noutput o = q·V\n"
    check(compile_error(src), src, where(src, 4, "V*V"), "not linear in 'V'", "multiplies the state by itself",
          width=3)


def test_update_applies_function_to_state():
    src = HEAD + "state S[dk, dv]\nS = exp(S)\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "exp(S)"), "not linear in 'S'", "applies a function to the state",
          width=6)


def test_nonlinearity_inside_a_function_points_at_the_call_that_passes_the_state():
    """A function applied to the state through a user function: the error is at the call `phi(q·S)` and names
    the definition — it pointed into the definition, `elu(x) + 1`, which every other call uses rightly (a
    probe's finding)."""
    src = HEAD + "phi(x) = elu(x) + 1\nstate S[dk, dv]\nS = 0.9·S + phi(k)⊗v + k⊗phi(q·S)\noutput o = phi(q)·S\n"
    check(compile_error(src), src, where(src, 5, "phi(q·S)"), "not linear in 'S'", "applies a function to the state",
          "(through 'phi', defined at line 3)", width=8)


def test_nonlinearity_hidden_in_a_value_points_at_the_value():
    src = HEAD + "state S[dk, dv]\nr = exp(S)\nS = r\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "exp(S)"), "not linear in 'S'")


def test_update_divides_by_the_state():
    src = HEAD + "state S[dk, dv]\nS = S/(1 + q·S·v)\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "S/"), "not linear in 'S'")


def test_update_with_constant_offset():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v + 1\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 4, "S +"), "cannot add a scalar to a matrix")


# ---- whole program -------------------------------------------------------------------------------
def test_state_without_update():
    src = HEAD + "state S[dk, dv], z[dk]\nS = S + k⊗v\noutput o = q·S\n"
    check(compile_error(src), src, where(src, 3, "z"), "state 'z' is never updated", "`z = …`", width=1)


def test_output_missing():
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\n"
    check(compile_error(src), src, (1, 1), "the program has no output", "output o = q·S")


def test_error_from_file_names_the_path(tmp_path):
    path = tmp_path / "broken.lin"
    src = HEAD + "state S[dk, dv]\nS = S + k⊗vv\noutput o = q·S\n"
    path.write_text(src, encoding="utf-8")
    with pytest.raises(LinrecError) as info:
        linrec.load(path)
    line, col = where(src, 4, "vv")
    assert str(info.value).startswith(f"{path}:{line}:{col}: error: unknown name 'vv'")


def test_missing_file(tmp_path):
    with pytest.raises(LinrecError) as info:
        linrec.load(tmp_path / "nope.lin")
    assert "cannot read" in str(info.value) and "nope.lin" in str(info.value)


# ---- runtime: bad arrays -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def delta():
    rec = linrec.load(EXAMPLES / "deltanet.lin")
    x = rec.random_inputs(batch=2, tokens=3, heads=2, dims={"dk": 5, "dv": 4}, seed=0)
    return rec, x


def runtime_error(rec, *args, **kwargs) -> str:
    with pytest.raises(RuntimeInputError) as info:
        rec.run(*args, **kwargs)
    assert isinstance(info.value, LinrecError)
    return str(info.value)


def test_missing_input(delta):
    rec, x = delta
    msg = runtime_error(rec, {k: v for k, v in x.items() if k != "k"})
    assert "missing input 'k'" in msg and "[B, T, H, dk]" in msg


def test_unknown_input_array(delta):
    rec, x = delta
    msg = runtime_error(rec, dict(x, kk=x["k"]))
    assert "unknown input array(s) 'kk'" in msg and "q, k, v, beta" in msg


def test_unknown_input_as_keyword(delta):
    rec, x = delta
    msg = runtime_error(rec, x, betta=x["beta"])
    assert "'betta'" in msg


def test_wrong_feature_size(delta):
    rec, x = delta
    msg = runtime_error(rec, dict(x, k=x["k"][..., :3]))
    assert "input 'k'" in msg and "has shape [2, 3, 2, 3]" in msg and "dk = 5 in input 'q'" in msg, msg


def test_a_wrong_size_is_blamed_on_the_input_that_disagrees():
    """The sizes are those most inputs agree on: a query cut short is named, not the key read after it (the
    first input's size used to bind the dimension, and the message blamed every input after it)."""
    rec = linrec.load(EXAMPLES / "gla.lin")
    x = rec.random_inputs(2, 3, 2, seed=0)
    msg = runtime_error(rec, dict(x, q=x["q"][..., :8]))
    assert msg == ("error: input 'q' should have shape [B, T, H, dk] = [2, 3, 2, 16] but has shape [2, 3, 2, 8] "
                   "(dk = 16 in input 'k' and input 'g')"), msg
    msg = runtime_error(rec, x, dims={"dk": 8})
    assert "dk = 8" in msg and "dk = 16" in msg, msg


def test_wrong_rank(delta):
    rec, x = delta
    msg = runtime_error(rec, dict(x, k=x["k"][..., 0]))
    assert "input 'k' should have shape [B, T, H, dk] but has shape [2, 3, 2]" in msg


def test_wrong_token_count(delta):
    rec, x = delta
    msg = runtime_error(rec, dict(x, v=x["v"][:, :2]))
    assert "input 'v' has [B, T, H] = [2, 2, 2]" in msg and "[2, 3, 2]" in msg


def test_integer_dtype(delta):
    rec, x = delta
    msg = runtime_error(rec, dict(x, q=np.ones(x["q"].shape, dtype=np.int64)))
    assert "input 'q' has dtype int64" in msg and "float32 or float64" in msg


def test_mixed_dtypes(delta):
    rec, x = delta
    msg = runtime_error(rec, dict(x, v=x["v"].astype(np.float32)))
    assert "input 'v' is float32" in msg and "float64" in msg and "one dtype" in msg


def test_value_outside_declared_range(delta):
    rec, x = delta
    beta = x["beta"].copy()
    beta[1, 2, 0] = 1.5
    msg = runtime_error(rec, dict(x, beta=beta))
    assert "input 'beta' must lie in (0, 1)" in msg and "1.5" in msg and "[1, 2, 0]" in msg


def test_nan_outside_declared_range(delta):
    rec, x = delta
    msg = runtime_error(rec, dict(x, beta=np.full_like(x["beta"], np.nan)))
    assert "input 'beta' must lie in (0, 1)" in msg and "nan" in msg


def test_one_sided_bound():
    rec = linrec.load(EXAMPLES / "gla.lin")
    x = rec.random_inputs(batch=1, tokens=2, heads=1, dims={"dk": 3, "dv": 2}, seed=0)
    g = x["g"].copy()
    g[0, 1, 0, 2] = 0.25
    msg = runtime_error(rec, dict(x, g=g))
    assert "input 'g' must lie in (-inf, 0]" in msg and "0.25" in msg and "[0, 1, 0, 2]" in msg
    g[0, 1, 0, 2] = 0.0  # the bound itself is allowed (g <= 0)
    assert np.all(np.isfinite(rec.run(dict(x, g=g)).outputs["o"]))


def test_wrong_initial_state_shape(delta):
    rec, x = delta
    msg = runtime_error(rec, x, initial_state={"S": np.zeros((2, 2, 4, 5))})
    assert "initial state 'S' should have shape [B, H, dk, dv] = [2, 2, 5, 4] but has shape [2, 2, 4, 5]" in msg


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_step_calls_its_state_a_state(backend):
    """In a decode step the state is the one the step goes on from: NumPy's step said "initial state 'S'" as
    run does, C's "state 'S'". Both say "state" now; run and prefill keep "initial state"."""
    rec = linrec.load(EXAMPLES / "deltanet.lin")
    token = {k: np.ascontiguousarray(v[:, 0]) for k, v in
             rec.random_inputs(batch=3, tokens=1, heads=2, dims={"dk": 5, "dv": 4}, seed=0).items()}
    with pytest.raises(RuntimeInputError, match=r"^error: state 'S' should have shape .*\[3, 2, 5, 4\] but has shape "
                                                r"\[2, 2, 5, 4\]$"):
        rec.step(token, {"S": np.zeros((2, 2, 5, 4))}, backend=backend)
    with pytest.raises(RuntimeInputError, match=r"^error: state 'S' has dtype int64; pass float32 or float64$"):
        rec.step(token, {"S": np.zeros((3, 2, 5, 4), np.int64)}, backend=backend)


def test_unknown_initial_state(delta):
    rec, x = delta
    msg = runtime_error(rec, x, initial_state={"Z": np.zeros((2, 2, 5, 4))})
    assert "unknown state(s) 'Z'" in msg and "are S" in msg


def test_integer_initial_state(delta):
    rec, x = delta
    msg = runtime_error(rec, x, initial_state={"S": np.zeros((2, 2, 5, 4), dtype=np.int64)})
    assert "initial state 'S' has dtype int64" in msg


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_state_or_param_of_none_is_called_none(backend):
    """A probe's finding: initial_state={'S': None} said "initial state 'S' has dtype object" (NumPy's array of
    None), and so did a param, a decode step's state and an input."""
    rec = linrec.load(EXAMPLES / "retnet.lin")
    x = rec.random_inputs(batch=1, tokens=2, heads=2, dims={"dk": 3, "dv": 2}, seed=0)
    token = {k: v[:, 0] for k, v in x.items()}
    calls = [(lambda: rec.run(x, backend=backend, initial_state={"S": None}),
              "initial state 'S' is None; pass an array, or leave it out for zeros"),
             (lambda: rec.vjp(x, {"o": np.ones((1, 2, 2, 2))}, backend=backend, initial_state={"S": None}),
              "initial state 'S' is None; pass an array, or leave it out for zeros"),
             (lambda: rec.run(x, backend=backend, params={"gamma": None}),
              "parameter 'gamma' is None; pass an array, or leave it out where it has a default"),
             (lambda: rec.step(token, {"S": None}, backend=backend), "state 'S' is None; pass an array"),
             (lambda: rec.run(dict(x, q=None), backend=backend), "input 'q' is None; pass an array")]
    for call, message in calls:
        with pytest.raises(RuntimeInputError) as info:
            call()
        assert str(info.value) == f"error: {message}"


def test_unknown_param(delta):
    rec, x = delta
    msg = runtime_error(rec, x, params={"gamma": np.ones(2)})
    assert "unknown parameter(s) 'gamma'" in msg and "none" in msg


def test_unknown_param_lists_the_real_ones():
    rec = linrec.load(EXAMPLES / "retnet.lin")
    x = rec.random_inputs(batch=1, tokens=2, heads=2, dims={"dk": 3, "dv": 2}, seed=0)
    msg = runtime_error(rec, x, params={"gama": np.ones(2)})
    assert "unknown parameter(s) 'gama'" in msg and "gamma" in msg
    msg = runtime_error(rec, x, params={"gamma": np.ones(3)})
    assert "parameter 'gamma' should have shape [H] = [2] but has shape [3]" in msg
    msg = runtime_error(rec, x, params={"gamma": np.ones(2, dtype=np.int64)})
    assert "parameter 'gamma' has dtype int64" in msg


def test_inputs_given_as_a_list_or_twice(delta):
    rec, x = delta
    assert "inputs must be a dict of arrays by name, got a list" in runtime_error(rec, [x["q"]])
    assert "input(s) 'q' given twice, in `inputs` and as a keyword" in runtime_error(rec, x, q=x["q"])
    with pytest.raises(RuntimeInputError, match="grad_outputs must be a dict of arrays by name, got a list"):
        rec.vjp(x, [np.ones((2, 3, 2, 4))])


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_states_params_and_outs_given_as_a_list(backend):
    """rec.run(x, initial_state=[1, 2]) was an AttributeError ('list' object has no attribute 'items'), as were
    step's, prefill's, bind_step's and vjp's state dicts and params= given as lists."""
    rec = linrec.compile(HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n", FILE)
    x = rec.random_inputs(1, 2, 1)
    token = {name: value[:, 0] for name, value in x.items()}
    state = rec.prefill(x, backend=backend).final_state
    calls = {
        "initial_state must be a dict of state name → array, got a list": [
            lambda: rec.run(x, backend=backend, initial_state=[1, 2]),
            lambda: rec.prefill(x, backend=backend, initial_state=[1, 2]),
            lambda: rec.vjp(x, {"o": np.ones((1, 2, 1, 3))}, backend=backend, initial_state=[1, 2])],
        "state must be a dict of state name → array, got a tuple": [
            lambda: rec.step(token, (1, 2), backend=backend),
            lambda: rec.bind_step(token, (1, 2), backend=backend)],
        "params must be a dict of parameter name → array, got a list": [
            lambda: rec.run(x, backend=backend, params=[1]),
            lambda: rec.step(token, state, backend=backend, params=[1]),
            lambda: rec.vjp(x, {"o": np.ones((1, 2, 1, 3))}, backend=backend, params=[1])],
        "grad_final_state must be a dict of state name → array, got a list": [
            lambda: rec.vjp(x, {"o": np.ones((1, 2, 1, 3))}, backend=backend, grad_final_state=[1])],
        "out must be a dict of output name → array, got a list": [
            lambda: rec.step(token, state, backend=backend, out=[1])],
    }
    for message, tries in calls.items():
        for call in tries:
            with pytest.raises(RuntimeInputError) as info:
                call()
            assert str(info.value) == f"error: {message}"


def test_a_param_others_are_computed_from_is_checked_first():
    """Mamba-2's A = −exp(A_log): a string, a dict or a wrong shape for A_log is the usual error, not NumPy's
    (it met them inside the default of A); A_log = +∞ is the caller's value, so A = −∞ (a reset at every
    token, guarantees.md), as A = −∞ given itself."""
    rec = linrec.load(EXAMPLES / "mamba2.lin")
    x = rec.random_inputs(batch=1, tokens=4, heads=3, dims={"dk": 3, "dv": 2}, seed=0)
    assert "parameter 'A_log' should have shape [H] = [3] but has shape [4]" in \
        runtime_error(rec, x, params={"A_log": np.zeros(4)})
    assert "parameter 'A_log' has dtype <U1" in runtime_error(rec, x, params={"A_log": ["a", "b", "c"]})
    assert "parameter 'A' has dtype object" in runtime_error(rec, x, params={"A": {"h": 1}})
    reset = rec.run(x, params={"A_log": np.full(3, np.inf)}).outputs["y"]
    np.testing.assert_array_equal(reset, rec.run(x, params={"A": np.full(3, -np.inf)}).outputs["y"])


# (options are RuntimeInputErrors, as docs/guarantees.md says — a probe found these plain LinrecErrors)
def test_thread_counts_as_numpy_integers_but_not_bools(delta):
    rec, x = delta
    rec.run(x, backend="c", threads=np.int64(2))
    with pytest.raises(RuntimeInputError, match="the thread count must be a positive integer, got True"):
        rec.run(x, backend="c", threads=True)
    with pytest.raises(RuntimeInputError, match="the thread count must be a positive integer, got 0"):
        rec.vjp(x, None, backend="c", threads=0, missing="zero")


def test_unknown_form(delta):
    rec, x = delta
    with pytest.raises(RuntimeInputError) as info:
        rec.run(x, form="sideways")
    assert "unknown form 'sideways'" in str(info.value) and "recurrent" in str(info.value)
    with pytest.raises(RuntimeInputError, match="unknown form 'sideways'; choose one of recurrent"):
        rec.vjp(x, None, form="sideways", missing="zero")
    with pytest.raises(LinrecError) as info:  # a forward form without a backward of its own: said so, not "unknown"
        rec.vjp(x, None, form="step", missing="zero")
    assert "the decode step has no backward of its own" in str(info.value) and "form='recurrent'" in str(info.value)


@pytest.mark.parametrize("form", ["auto", "chunkwise"])
def test_unknown_backend(delta, form):
    rec, x = delta
    with pytest.raises(RuntimeInputError) as info:
        rec.run(x, form=form, backend="gpu")
    assert "unknown backend 'gpu'; choose one of numpy, c" in str(info.value)


def test_runtime_errors_have_no_source_position(delta):
    rec, x = delta
    with pytest.raises(RuntimeInputError) as info:
        rec.run({k: v for k, v in x.items() if k != "q"})
    assert info.value.span is None
    assert str(info.value).startswith("error: missing input 'q'")


# ---- warnings: legal, but almost certainly not meant ----
UNUSED = HEAD.replace("input q[dk], k[dk], v[dv]", "input q[dk], k[dk], v[dv], extra[dk]") + (
    "param p = 2\nphi(x) = x*2\nlost = q*2\nstate S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n")


def test_declared_names_nothing_uses_are_warned_with_their_places():
    rec = linrec.compile(UNUSED, FILE)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")  # a warning stops nothing
    texts = [str(w) for w in rec.warnings]
    expected = [(where(UNUSED, 2, "extra"), "input 'extra' is declared but never used; every call must still pass"),
                (where(UNUSED, 3, "p", 2), "parameter 'p' is declared but never used"),
                (where(UNUSED, 4, "phi"), "function 'phi' is declared but never used"),
                (where(UNUSED, 5, "lost"), "value 'lost' is declared but never used")]
    assert len(texts) == len(expected)
    for text, ((line, col), message) in zip(texts, expected):
        assert text.startswith(f"{FILE}:{line}:{col}: warning: {message}"), text


def test_names_used_only_through_other_declarations_are_not_warned():
    src = HEAD + ("param a = 2\nparam b = a*3\nphi(x) = x*b\nkk = phi(k)\nstate S[dk, dv]\nS = S + kk⊗v\n"
                  "output o = q·S\n")
    assert linrec.compile(src, FILE).warnings == ()
    for path in sorted(EXAMPLES.glob("*.lin")):
        assert linrec.load(path).warnings == (), path.name


def test_check_prints_warnings_to_stderr_and_in_its_json(tmp_path, capsys):
    from linrec.cli import main
    path = tmp_path / "unused.lin"
    path.write_text(UNUSED)
    assert main(["check", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and "warning: input 'extra' is declared but never used" in err
    assert main(["check", str(path), "--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert [w["line"] for w in warnings] == [2, 3, 4, 5]


def test_messages_found_by_probing_the_front_end():
    """A repeated option silently took the last value (randn(seed=0, seed=1)), or was blamed on another call
    (seq's window); `param a = a + 1` said "did you mean 'a'?"; a builtin without options listed "(options: )";
    a comment holding U+2028 (or \\f, \\v) made the error quote another line than the one it names; a text with
    old Macs' bare CR line ends, which load() takes, was refused by compile()."""
    head = "recurrence t(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\n"
    body = "state S[dk, dv]\nS = a·S + k⊗v\noutput o = q·S\n"
    assert "option 'seed' is given twice" in str(compile_error(head + "param a = randn(seed=0, seed=1)\n" + body))
    err = compile_error(head + "output o = softmax(seq(k, window=4, window=8)·q)·seq(v, window=4)\n")
    assert "option 'window' is given twice" in str(err) and err.span.column == 37
    assert "'a' is defined here from itself" in str(compile_error(head + "param a = a + 1\n" + body))
    assert "'softplus' has no option 'beta'; it takes none" in \
        str(compile_error(head + "state S[dk, dv]\nS = S + k⊗v\noutput o = softplus(q, beta=2)·S\n"))
    for mark in ("\u2028", "\f", "\v", "\x85"):
        err = compile_error(head + f"# a comment {mark} with a mark\nstate S[dk, dv]\nS = S + k⊗v\noutput o = q·S + $\n")
        assert err.span.line == 6 and "output o = q·S + $" in str(err).splitlines()[1], repr(mark)
    # `param A[dk, dk] = 0.5*I` was refused ("has shape [?, ?]"): I takes its size from the declaration
    eye = linrec.compile(head + "param A[dk, dk] = 0.5*I\nstate S[dk, dv]\nS = A·S + k⊗v\noutput o = q·S\n", "eye.lin")
    np.testing.assert_array_equal(eye.default_params(1, {"dk": 4, "dv": 4})["A"], 0.5 * np.eye(4))
    # a text with old Macs' bare CR line ends: refused by compile() and load() alike, with the reason (load
    # read the file with universal newlines and took it), the line shown with ␍ (a terminal would go back)
    cr = (head + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n").replace("\n", "\r")
    path = Path(tempfile.mkdtemp()) / "cr.lin"
    path.write_bytes(cr.encode("utf-8"))
    for err in (compile_error(cr), pytest.raises(LinrecError, linrec.load, path).value):
        assert "a carriage return alone: old Macs' line ends" in str(err) and "\r" not in str(err).splitlines()[1]
    crlf = cr.replace("\r", "\r\n")
    assert linrec.compile(crlf, "crlf.lin").forms == linrec.compile(crlf.replace("\r\n", "\n"), "lf.lin").forms
