"""The three-node RabbitMQ 4 cluster's tests: a package, so that they share one cluster."""
