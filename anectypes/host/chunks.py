"""Working through large arrays in cache-sized pieces, and dealing the pieces to lanes (threads).

Two piece sizes, each sized for its passes: the fp16 conversions read and write one array at a time,
AdamW's update four (weight, gradient, two moments) plus its work buffers, all in a core's L2 cache."""

CONVERT_CHUNK = 1 << 18     # elements per pass of the fp16 rounding and conversion
UPDATE_CHUNK = 1 << 16      # elements per piece of the optimizer update


def chunks(*arrays, size=CONVERT_CHUNK):
    """Matching flat slices of at most `size` elements of C-contiguous arrays (views: writes land)."""
    if not all(a.flags.c_contiguous for a in arrays):
        raise ValueError("chunks() works in place on C-contiguous arrays")
    flats = [a.reshape(-1) for a in arrays]
    for i in range(0, flats[0].size, size):
        yield [f[i:i + size] for f in flats]


def in_lanes(work, items, lanes, map=map):
    """work(lane, its items) for each of `lanes` lanes, which take the items in turn (item j goes to lane
    j mod lanes); `map` may run the lanes on as many threads (numpy lets go of the GIL inside each call)."""
    list(map(lambda i: work(i, items[i::lanes]), range(min(lanes, len(items)))))
