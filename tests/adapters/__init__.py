"""Adapter tests against the in-process fake AMQP peer (``tests/fake``): no broker needed."""
