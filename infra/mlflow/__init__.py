"""A local MLflow tracking server (sqlite backend, local or S3 artifacts)."""
