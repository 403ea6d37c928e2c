"""``python -m reliable_amqp``: the ``reliable-amqp`` command line."""

import sys

from reliable_amqp.cli import main

if __name__ == "__main__":
    sys.exit(main())
