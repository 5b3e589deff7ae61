from __future__ import annotations

from django.apps import AppConfig


class PoolingConfig(AppConfig):
    name = "pooling"
    verbose_name = "Model pooling"
