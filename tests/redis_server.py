"""A real `redis-server` for tests: kv_store/l3/redis_process.py, re-exported under its old name.

Without the Debian package redis-server (`scripts/setup.sh test`) the tests that start one fail and say so.
"""

from kv_store.l3.redis_process import RedisServer, free_loopback_port, redis_server_binary, redis_server_path

__all__ = ["RedisServer", "free_loopback_port", "redis_server_binary", "redis_server_path"]
