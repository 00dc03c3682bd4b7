"""A single-node Kafka broker (KRaft) built from Maven Central jars."""
