"""Old import path of :class:`kvgrid.controller.index.redis.RedisIndex` (kept for importers)."""

from kvgrid.controller.index.redis import RedisIndex

__all__ = ["RedisIndex"]
