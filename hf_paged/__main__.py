"""``python -m hf_paged``: the ``hf-paged`` command line."""

import sys

from hf_paged.cli import main

sys.exit(main())
