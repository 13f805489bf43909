"""The MIL toolchain: builder, parser, BLOBFILE blobs and the numpy interpreter."""

from .builder import Builder
from .interp import Plan, run
from .parser import parse
from .program import Program
from .types import DIALECTS, TensorType

__all__ = ["Builder", "Plan", "Program", "TensorType", "DIALECTS", "parse", "run"]
