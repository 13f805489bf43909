"""Parse MIL text (both dialects of docs/ane-reference.md §3.1–3.5) into a typed, shape-checked Program.

Every error is a MILError naming the line, the column, the op and what was expected there, quoting at
most QUOTE_LIMIT characters of any name or token. Brackets nest at most MAX_NESTING deep, no tensor may
need more than this machine's memory, and a flat list of numbers is read at once (Lexer.numbers).
"""

import re
import warnings

import numpy as np

from ..errors import MILError
from ..host.system import physical_memory
from .ops import OPS
from .program import BlobRef, Function, Operation, Program, Var, bind, computed_from_consts
from .types import DIALECTS, NUMPY, TensorType, as_value, shorten

TOKEN = re.compile(r"""
    (?P<ws>\s+|//[^\n]*)
  | (?P<string>"(?:\\.|[^"\\\n])*")
  | (?P<number>[-+](?:inf|nan)(?![A-Za-z0-9_.])|[-+]?(?:0[xX][0-9a-fA-F]*\.?[0-9a-fA-F]*[pP][-+]?\d+|\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>->|[()\[\]{}<>,=;])
""", re.VERBOSE)


NESTING = {"(": 1, "[": 1, "{": 1, "<": 1, ")": -1, "]": -1, "}": -1, ">": -1}
MAX_NESTING = 64                    # open brackets of all kinds; the parser recurses once per level
# a list of decimal numbers, maybe (Lexer.numbers checks the rest); ASCII spaces: MIL's \s is Unicode's
NUMBERS = re.compile(r"\[([-+.0-9eE, \t\n\r\f\v]*)\]")
SPACES = str.maketrans("", "", " \t\n\r\f\v")
NEGATIVE_ZERO = re.compile(r"-0+(?![.0-9eE])")   # the integer -0, which is 0 (or an exponent -0: no matter)


class Token:
    __slots__ = ("kind", "text", "line", "col", "pos")

    def __init__(self, kind, text, line, col, pos):
        self.kind, self.text, self.line, self.col, self.pos = kind, text, line, col, pos

    def __repr__(self):
        return "end of text" if self.kind == "eof" else repr(shorten(self.text))


class Lexer:
    """MIL text as tokens, the next one when the parser asks for it (or a list of numbers at once)."""

    def __init__(self, text):
        self.text, self.pos, self.line, self.line_start, self.depth = text, 0, 1, 0, 0

    def next(self):
        while self.pos < len(self.text):
            m = TOKEN.match(self.text, self.pos)
            col = self.pos - self.line_start + 1
            if not m:
                if self.text[self.pos] == '"':
                    raise MILError("unterminated string: a string literal must end with '\"' on the same line",
                                   self.line, col)
                raise MILError(f"unexpected character {self.text[self.pos]!r}", self.line, col)
            line, pos = self.line, self.pos
            self.skip_to(m.end())
            if m.lastgroup != "ws":
                self.depth += NESTING.get(m.group(), 0)
                if self.depth > MAX_NESTING:
                    raise MILError(f"brackets nested more than {MAX_NESTING} deep", line, col)
                return Token(m.lastgroup, m.group(), line, col, pos)
        return Token("eof", "", self.line, self.pos - self.line_start + 1, self.pos)

    def skip_to(self, end):
        """Move on to `end`, counting the lines passed."""
        newlines = self.text.count("\n", self.pos, end)
        if newlines:
            self.line += newlines
            self.line_start = self.text.rindex("\n", self.pos, end) + 1
        self.pos = end

    def numbers(self, bracket):
        """The list of decimal numbers that the `[` token `bracket` (the last one read) opens, read at
        once, and the lexer on after its `]`: an int64 array if they are all integers, else float64. None
        (and nothing read) for anything else, for numbers of 2**53 or more (integers exact only
        token by token), and for an integer -0 among floats (token by token it is 0, not -0.0)."""
        m = NUMBERS.match(self.text, bracket.pos)
        items = m.group(1).translate(SPACES) if m else ""
        if not items or ",," in items or items[0] == "," or items[-1] == ",":   # numpy reads an empty item as -1
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)   # numpy < 2 warns and stops at a malformed item
            try:                                                  # (numpy >= 2 raises): both read MIL's numbers
                values = np.fromstring(m.group(1), np.float64, sep=",")
            except ValueError:
                return None
        integers = not any(c in items for c in ".eE")
        if (values.size != items.count(",") + 1 or not np.all(np.abs(values) < 2**53)
                or not integers and NEGATIVE_ZERO.search(items)):
            return None
        self.skip_to(m.end())
        self.depth -= 1
        return values.astype(np.int64) if integers else values


def tokenize(text):
    """All the tokens of `text`, end of text included."""
    lexer, tokens = Lexer(text), []
    while not tokens or tokens[-1].kind != "eof":
        tokens.append(lexer.next())
    return tokens


def number(text):
    """The value of a number token. An integer of 40 digits or more stands as ±10**40: like it, out of range
    of every MIL type (fp32's largest is 3.4e38), and int() refuses 4300 digits."""
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text) if len(text.lstrip("+-").lstrip("0")) < 40 else (-1 if text[0] == "-" else 1) * 10**40
    return float.fromhex(text) if "x" in text.lower() else float(text)


class Parser:
    def __init__(self, text):
        self.lexer = Lexer(text)
        self.tok = self.lexer.next()
        self.dialect = None
        self.memory = physical_memory()        # no tensor may need more

    # -- token helpers
    def advance(self):
        self.tok = self.lexer.next()

    def error(self, message, tok=None, op=None):
        tok = tok or self.tok
        return MILError(message, tok.line, tok.col, op and shorten(op))

    def take(self, text=None, kind=None, what=None):
        t = self.tok
        if (text is not None and t.text != text) or (kind is not None and t.kind != kind):
            raise self.error(f"expected {what or repr(text) if text else what or kind}, found {t!r}")
        self.advance()
        return t

    def accept(self, text):
        if self.tok.text == text and self.tok.kind in ("punct", "ident"):
            self.advance()
            return True
        return False

    # -- grammar
    def program(self):
        self.take("program")
        self.take("(")
        version = self.take(kind="number", what="a program version such as 1.3").text
        self.take(")")
        if self.tok.text == "[":
            self.attributes()                      # buildInfo: informational, printed anew by the emitter
        self.take("{")
        functions = {}
        while self.tok.text == "func":
            func_tok = self.tok
            f = self.function()
            if f.name in functions:
                raise self.error(f"function '{shorten(f.name)}' is defined twice", func_tok)
            functions[f.name] = f
        self.take("}", what="'func' or the closing '}' of the program")
        self.take(kind="eof", what="end of text after the program")
        if "main" not in functions:
            raise MILError("the program has no 'main' function", 1, 1)
        return Program(self.dialect, functions, version)

    def function(self):
        self.take("func")
        name = self.take(kind="ident", what="a function name").text
        self.take("<")
        opset_tok = self.take(kind="ident", what="an opset such as ios18")
        if opset_tok.text not in DIALECTS:
            raise self.error(f"unsupported opset '{shorten(opset_tok.text)}'; anectypes reads "
                             + " and ".join(DIALECTS), opset_tok)
        if self.dialect and self.dialect.name != opset_tok.text:
            raise self.error("all functions must use one opset", opset_tok)
        self.dialect = DIALECTS[opset_tok.text]
        self.take(">")
        self.take("(")
        scope, inputs = {}, []
        while self.tok.text != ")":
            if inputs:
                self.take(",", what="',' or ')' in the parameter list")
            ttype = self.type()
            tok = self.take(kind="ident", what="a parameter name")
            self.define(scope, Var(tok.text, ttype), tok)
            inputs.append(scope[tok.text])
        self.take(")")
        self.take("{")
        f, names = Function(name, inputs), set()
        while self.tok.text != "}":
            f.ops.append(self.statement(scope, names))
        self.take("}")
        self.take("->", what="'->' and the output list after the function body")
        self.take("(")
        while True:
            tok = self.take(kind="ident", what="an output variable name")
            if tok.text not in scope:
                raise self.error(f"output '{shorten(tok.text)}' is not defined in function '{shorten(name)}'", tok)
            f.outputs.append(scope[tok.text])
            if not self.accept(","):
                break
        self.take(")")
        self.take(";")
        return f

    def define(self, scope, var, tok, opname=None):
        if var.name in scope:
            raise self.error(f"variable '{shorten(var.name)}' is defined twice (MIL variables are single-assignment)",
                             tok, opname)
        scope[var.name] = var

    def type(self):
        tok = self.tok
        if self.accept("tensor"):
            self.take("<")
            dtype = self.dtype()
            self.take(",")
            self.take("[")
            dims = []
            while self.tok.text != "]":
                if dims:
                    self.take(",", what="',' or ']' in the shape")
                d = self.take(kind="number", what="a dimension")
                if not d.text.isdigit():
                    raise self.error(f"dimension must be a non-negative integer, found {shorten(d.text)}", d)
                dims.append(number(d.text))
                if dims[-1] > 2**31 - 1:
                    raise self.error(f"dimension {shorten(d.text)} is too large (at most {2**31 - 1})", d)
            self.take("]")
            self.take(">")
            ttype = TensorType(dtype, tuple(dims))
            if self.memory and ttype.nbytes > self.memory:
                raise self.error(f"{ttype} needs {ttype.nbytes / 2**30:,.1f} GiB, more than the "
                                 f"{self.memory / 2**30:,.1f} GiB of memory this machine has", tok)
            return ttype
        if tok.kind == "ident" and tok.text in NUMPY:
            if self.dialect and self.dialect.verbose_scalars:
                raise self.error(f"the {self.dialect.name} dialect spells scalars in full: "
                                 f"tensor<{tok.text}, []>, not {tok.text}")
            self.advance()
            return TensorType(tok.text)
        if self.accept("dict"):
            self.take("<")
            self.type()
            self.take(",")
            self.type()
            self.take(">")
            return TensorType("dict")
        raise self.error(f"expected a type such as tensor<fp16, [1, 64, 1, 32]>, found {tok!r}")

    def dtype(self):
        tok = self.take(kind="ident", what="a dtype")
        if tok.text not in NUMPY:
            raise self.error(f"unknown dtype '{shorten(tok.text)}'; MIL dtypes are {', '.join(NUMPY)}", tok)
        return tok.text

    def statement(self, scope, names):
        ttype = self.type()
        out_tok = self.take(kind="ident", what="the variable being defined")
        self.take("=")
        op_tok = self.take(kind="ident", what="an op name")
        opname = op_tok.text
        self.take("(")
        args = {}
        while self.tok.text != ")":
            if args:
                self.take(",", what="',' or ')' in the argument list")
            key = self.take(kind="ident", what="an argument name")
            self.take("=")
            if key.text in args:
                raise self.error(f"argument '{shorten(key.text)}' given twice", key, opname)
            args[key.text] = self.argument(scope, opname, key.text)
        self.take(")")
        attrs = self.attributes(opname) if self.tok.text == "[" else {}
        self.take(";", what="';' after the statement")
        name = attrs.pop("name", None)
        if name is None:
            raise self.error('missing the name attribute: every op needs [name = string("...")]', op_tok, opname)
        if not isinstance(name.value, str):
            raise self.error("the name attribute must be a string", op_tok, opname)
        if name.value in names:
            raise self.error(f"op name \"{shorten(name.value)}\" is used twice", op_tok, opname)
        names.add(name.value)
        try:
            if opname == "const":
                if args or set(attrs) != {"val"}:
                    extra = sorted(set(args) | set(attrs) - {"val"})
                    raise MILError(f"const takes only name and val attributes (unexpected: {shorten(extra)})"
                                   if extra else "const needs a val attribute", op="const")
                op, out_type = None, attrs["val"].type
                out = Var(out_tok.text, out_type, attrs["val"].value, attrs["val"].blob)
            else:
                if attrs and not getattr(OPS.get(opname), "in_attributes", False):
                    raise MILError(f"unknown attribute '{shorten(sorted(attrs)[0])}' (only name is allowed here)",
                                   op=opname)
                op, out_type = bind(opname, {**args, **attrs}, self.dialect)
                out = Var(out_tok.text, out_type, from_consts=computed_from_consts(op, {**args, **attrs}))
                if op.in_attributes:               # constexpr ops: a constant the compiler folds
                    args = attrs
        except MILError as e:
            raise self.error(e.reason, op_tok, e.op) from None
        if (ttype.dtype, ttype.shape) != (out_type.dtype, out_type.shape):
            raise self.error(f"declared type {ttype} does not match the {out_type} that {opname} produces",
                             out_tok, opname)
        self.define(scope, out, out_tok, opname)
        return Operation(op, out, args, name.value, op_tok.line, op_tok.col)

    def argument(self, scope, opname, key):
        if self.accept("("):
            vals = [self.variable(scope, opname)]
            while self.accept(","):
                vals.append(self.variable(scope, opname))
            self.take(")")
            return tuple(vals)
        return self.variable(scope, opname)

    def variable(self, scope, opname):
        tok = self.take(kind="ident", what="a variable name (constants are declared with const())")
        if tok.text not in scope:
            raise self.error(f"undefined variable '{shorten(tok.text)}'", tok, opname)
        return scope[tok.text]

    def attributes(self, opname=None):
        self.take("[")
        attrs = {}
        while self.tok.text != "]":
            if attrs:
                self.take(",", what="',' or ']' in the attribute list")
            key = self.take(kind="ident", what="an attribute name")
            self.take("=")
            if key.text in attrs:
                raise self.error(f"attribute '{shorten(key.text)}' given twice", key, opname)
            attrs[key.text] = self.literal(opname)
        self.take("]")
        return attrs

    def literal(self, opname=None):
        """`TYPE(value)` -> a const Var holding its value (or its BLOBFILE reference)."""
        tok = self.tok
        ttype = self.type()
        self.take("(", what=f"'(' and the value of the {ttype} literal")
        if ttype.dtype == "dict":
            self.dict_body()
            self.take(")")
            return Var("", ttype, {})
        if self.tok.text == "BLOBFILE":
            var = Var("", ttype, blob=self.blobfile(ttype))
        else:
            raw = self.value()
            try:
                var = Var("", ttype, as_value(ttype, raw))
            except MILError as e:
                raise self.error(e.reason, tok, opname) from None
        self.take(")", what=f"')' closing the {ttype} literal")
        return var

    def blobfile(self, ttype):
        tok = self.take("BLOBFILE")
        if not ttype.shape:
            raise self.error("a BLOBFILE value needs a tensor type with a shape", tok)
        self.take("(")
        fields = {}
        while self.tok.text != ")":
            if fields:
                self.take(",")
            key = self.take(kind="ident", what="path or offset")
            self.take("=")
            fields[key.text] = self.literal()
        self.take(")")
        if set(fields) != {"path", "offset"}:
            raise self.error(f"BLOBFILE needs exactly path and offset, got {shorten(sorted(fields))}", tok)
        path, offset = fields["path"], fields["offset"]
        if path.type.dtype != "string" or offset.type.dtype != "uint64":
            raise self.error("BLOBFILE path must be a string and offset a uint64", tok)
        return BlobRef(path.value, int(offset.value))

    def value(self):
        tok = self.tok
        if tok.text == "[":
            numbers = self.lexer.numbers(tok)
            if numbers is not None:
                self.advance()
                return numbers
        if self.accept("["):
            items = []
            while self.tok.text != "]":
                if items:
                    self.take(",", what="',' or ']' in the list")
                items.append(self.value())
            self.take("]")
            return [x for item in items for x in (item if isinstance(item, (list, np.ndarray)) else [item])]
        self.advance()
        if tok.kind == "string":
            return re.sub(r"\\(.)", r"\1", tok.text[1:-1])
        if tok.kind == "number" or tok.text in ("inf", "nan"):   # non-finite floats as coremlc prints them
            return number(tok.text)
        if tok.text in ("true", "false"):
            return tok.text == "true"
        raise self.error(f"expected a value (number, true/false, string or [list]), found {tok!r}", tok)

    def dict_body(self):
        depth = 0
        while not (depth == 0 and self.tok.text == ")"):
            if self.tok.kind == "eof":
                raise self.error("unterminated dict literal")
            depth += {"{": 1, "}": -1}.get(self.tok.text, 0)
            self.advance()


def parse(text):
    """Parse MIL text into a Program; raises MILError with line and column on any problem."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        raw = bytes(text)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            head = raw[:e.start]           # valid UTF-8 up to the bad byte: count lines and characters
            line, col = head.count(b"\n") + 1, len(head[head.rfind(b"\n") + 1:].decode("utf-8")) + 1
            raise MILError(f"MIL text is not UTF-8 (byte {e.start} is {raw[e.start]:#04x})", line, col) from None
    return Parser(text).program()
