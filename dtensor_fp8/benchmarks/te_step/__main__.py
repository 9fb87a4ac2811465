"""``python -m dtensor_fp8.benchmarks.te_step`` = ``python -m dtensor_fp8.benchmarks te_step``."""

import sys

from . import main

sys.exit(main())
