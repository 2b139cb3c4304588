"""``python -m turnkv`` is the ``turnkv`` command."""

from __future__ import annotations

import sys

from turnkv.cli import main

sys.exit(main())
