"""``python -m rudra_zmq`` is the ``rudra-zmq`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
