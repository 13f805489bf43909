"""The few exception types a user can cause. Each message says what was wrong and what to do."""


class AnectypesError(Exception):
    """Base class: anything raised on purpose by anectypes."""


class MILError(AnectypesError):
    """Malformed or ill-typed MIL text. Carries the position and the op when known."""

    def __init__(self, message, line=None, col=None, op=None):
        self.line, self.col, self.op, self.reason = line, col, op, message
        where = f"line {line}, col {col}: " if line is not None else ""
        what = f"op '{op}': " if op else ""
        super().__init__(f"{where}{what}{message}")


class BlobError(AnectypesError):
    """A BLOBFILE weight blob that is malformed, truncated or referenced at a bad offset."""


class BlasError(AnectypesError, ValueError):
    """Bad arguments to a BLAS call (dtype, shape, layout), or no BLAS library found."""


class DataError(AnectypesError):
    """A token file, tokenizer or corpus that cannot be used."""


class CheckpointError(AnectypesError):
    """A checkpoint file that is missing, damaged, of another format or version, or for another model."""


class DeviceError(AnectypesError):
    """A device could not compile, bind or evaluate a kernel."""


class ObjCError(DeviceError):
    """An Objective-C call failed; carries the framework's error description."""


class LayoutError(DeviceError):
    """The engine lays a kernel's tensor out otherwise than its surfaces are written; `layout`, its live I/O lists."""

    def __init__(self, message, layout):
        super().__init__(message)
        self.layout = layout


class CompileBudgetExceeded(DeviceError):
    """The device's compile budget is spent (the real ANE compiler leaks after ~119 compiles)."""
