"""A local S3-compatible object store (versitygw, posix backend) for tests and the local stack."""
