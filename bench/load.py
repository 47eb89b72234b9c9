"""The load tool as a bench script: `python bench/load.py --url http://127.0.0.1:8000 ...`
(the same as `rayguide loadtest`; see deploy/loadtest.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy.loadtest import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
