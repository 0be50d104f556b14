"""Layers: ``SyncBatchNorm`` (batch norm with statistics synchronised across
ranks, traceable by torch.compile) and ``convert_sync_batchnorm``."""

from .syncbn import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
