"""One probe in this process: `python -X faulthandler -m anectypes.doctor.child PROBE OPTIONS` prints the probe's
row as one JSON object on stdout, and nothing else there (what the probe prints goes to stderr). The ladder starts
it; a crash leaves faulthandler's traceback on stderr for the ladder to report."""

import faulthandler
import json
import os
import sys
import traceback


def main(argv):
    name, options = argv[0], json.loads(argv[1])
    faulthandler.enable()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                        # the probe's own output, Python's or C's, goes to stderr
    from ..errors import AnectypesError
    from .probes import PROBES, Fail, Skip
    row = dict(facts={}, diff=None, error=None)
    try:
        row.update(status="OK", **PROBES[name](options))
    except Skip as e:
        row.update(status="SKIP", summary=str(e))
    except Fail as e:
        row.update(status="FAIL", error=str(e), facts=e.facts, diff=e.diff)
    except AnectypesError as e:
        row.update(status="FAIL", error=f"{type(e).__name__}: {e}")
    except Exception:                   # a doctor reports what nothing else anticipated, with where it happened
        row.update(status="FAIL", error=traceback.format_exc().strip())
    if row["status"] == "FAIL":
        row["summary"] = row["error"].splitlines()[-1 if row["error"].startswith("Traceback") else 0]
    out.write(json.dumps(row, default=str))
    out.close()


if __name__ == "__main__":
    main(sys.argv[1:])
