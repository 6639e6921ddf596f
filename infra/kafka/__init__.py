"""A local Apache Kafka broker for development and tests.

`jars` resolves the broker's class path with Maven (cached outside the repository), `config`
renders server.properties / log4j.properties, `local` starts, waits for, and stops one broker
per state directory.
"""
from kvpipe.infra.kafka.local import BrokerStatus, InfraError, LocalKafka

__all__ = ["BrokerStatus", "InfraError", "LocalKafka"]
