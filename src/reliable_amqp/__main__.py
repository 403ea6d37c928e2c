"""``python -m reliable_amqp``: the ``reliable-amqp`` command line."""

from reliable_amqp.cli import run

if __name__ == "__main__":
    run()
