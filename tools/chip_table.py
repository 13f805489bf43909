"""Print docs/mil.md's table: the chip catalogue (docs/ane-reference.md §3.10) over the ten training
kernels of every preset, on every chip. `python tools/chip_table.py`."""

from anectypes.model.chips import table
from anectypes.model.config import PRESETS

if __name__ == "__main__":
    print(table(PRESETS))
