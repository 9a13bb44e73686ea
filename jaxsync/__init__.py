"""jaxsync: Megatron-style gradient sync and a ZeRO distributed optimizer for JAX."""

from jaxsync._src.checkpoint.checkpointer import Checkpointer as Checkpointer
from jaxsync._src.checkpoint.checkpointer import (
    CheckpointMismatchError as CheckpointMismatchError,
)
from jaxsync._src.checkpoint.checkpointer import (
    CorruptCheckpointError as CorruptCheckpointError,
)
from jaxsync._src.checkpoint.checkpointer import PartialSaveWarning as PartialSaveWarning
from jaxsync._src.checkpoint.checkpointer import Restored as Restored
from jaxsync._src.checkpoint.train_state import RestoredState as RestoredState
from jaxsync._src.core.axes import normalize_axes as normalize_axes
from jaxsync._src.core.names import param_name as param_name
from jaxsync._src.deterministic.units import Deterministic as Deterministic
from jaxsync._src.deterministic.units import UnitGrads as UnitGrads
from jaxsync._src.fsdp.fully_shard import FullyShard as FullyShard
from jaxsync._src.fsdp.fully_shard import fully_shard as fully_shard
from jaxsync._src.fsdp.gather import MixedPrecision as MixedPrecision
from jaxsync._src.fsdp.held import FsdpShards as FsdpShards
from jaxsync._src.fsdp.offload import host_offload_supported as host_offload_supported
from jaxsync._src.fsdp.offload import offload as offload
from jaxsync._src.fsdp.offload import with_offloaded_state as with_offloaded_state
from jaxsync._src.gpu.bound import CommunicationBound as CommunicationBound
from jaxsync._src.gpu.bound import communication_bound as communication_bound
from jaxsync._src.gpu.hlo import CollectiveStats as CollectiveStats
from jaxsync._src.gpu.hlo import collective_stats as collective_stats
from jaxsync._src.gpu.hlo import lowered_collective_counts as lowered_collective_counts
from jaxsync._src.gpu.overlap import CollectiveSite as CollectiveSite
from jaxsync._src.gpu.overlap import OverlapReport as OverlapReport
from jaxsync._src.gpu.overlap import overlap_report as overlap_report
from jaxsync._src.gpu.peak import MemoryReport as MemoryReport
from jaxsync._src.gpu.peak import PeakBuffer as PeakBuffer
from jaxsync._src.gpu.peak import memory_report as memory_report
from jaxsync._src.gpu.schedule import GPU_PERFORMANCE_OPTIONS as GPU_PERFORMANCE_OPTIONS
from jaxsync._src.gpu.schedule import SCHEDULE_OPTIONS as SCHEDULE_OPTIONS
from jaxsync._src.gpu.schedule import schedule_report as schedule_report
from jaxsync._src.gpu.target import GPUS as GPUS
from jaxsync._src.gpu.target import GpuSpec as GpuSpec
from jaxsync._src.gpu.target import gpu_target_available as gpu_target_available
from jaxsync._src.gpu.target import gpu_topology as gpu_topology
from jaxsync._src.gpu.timings import CollectiveTiming as CollectiveTiming
from jaxsync._src.gpu.timings import ComputationTiming as ComputationTiming
from jaxsync._src.gpu.timings import ScheduleReport as ScheduleReport
from jaxsync._src.gpu.traffic import KernelBytes as KernelBytes
from jaxsync._src.gpu.traffic import TrafficReport as TrafficReport
from jaxsync._src.gpu.traffic import hbm_bytes as hbm_bytes
from jaxsync._src.integrity.replicas import ReplicaMismatch as ReplicaMismatch
from jaxsync._src.integrity.replicas import ReplicaReport as ReplicaReport
from jaxsync._src.integrity.replicas import replica_check as replica_check
from jaxsync._src.integrity.rerun import Rerun as Rerun
from jaxsync._src.integrity.rerun import RerunReport as RerunReport
from jaxsync._src.integrity.stragglers import StragglerReport as StragglerReport
from jaxsync._src.integrity.stragglers import Stragglers as Stragglers
from jaxsync._src.layout.layout import Layout as Layout
from jaxsync._src.layout.ownership import WholeMatrices as WholeMatrices
from jaxsync._src.layout.ownership import whole_matrices as whole_matrices
from jaxsync._src.layout.placement import build_layout as build_layout
from jaxsync._src.layout.records import Bucket as Bucket
from jaxsync._src.layout.records import Buffer as Buffer
from jaxsync._src.layout.records import BufferKey as BufferKey
from jaxsync._src.layout.records import ParamSlot as ParamSlot
from jaxsync._src.layout.records import PieceRange as PieceRange
from jaxsync._src.multihost.data import shard_batch as shard_batch
from jaxsync._src.multihost.distributed import ProcessInfo as ProcessInfo
from jaxsync._src.multihost.distributed import initialize as initialize
from jaxsync._src.optim.clip import clip_by_global_norm as clip_by_global_norm
from jaxsync._src.optim.logged import TrainerMetrics as TrainerMetrics
from jaxsync._src.optim.loss_scale import DynamicLossScale as DynamicLossScale
from jaxsync._src.optim.loss_scale import LossScaleState as LossScaleState
from jaxsync._src.optim.metrics import nonfinite_report as nonfinite_report
from jaxsync._src.optim.optimizer import DistributedOptimizer as DistributedOptimizer
from jaxsync._src.optim.optimizer import distributed_optimizer as distributed_optimizer
from jaxsync._src.optim.routing import OwnedMatrix as OwnedMatrix
from jaxsync._src.optim.routing import OwnershipReport as OwnershipReport
from jaxsync._src.optim.routing import muon_labels as muon_labels
from jaxsync._src.optim.routing import ownership_report as ownership_report
from jaxsync._src.optim.state import DistributedOptimizerState as DistributedOptimizerState
from jaxsync._src.optim.state import StepMetrics as StepMetrics
from jaxsync._src.step.builder import MultiStepsWarning as MultiStepsWarning
from jaxsync._src.step.builder import train_step as train_step
from jaxsync._src.step.models.linen_scan import linen_scan as linen_scan
from jaxsync._src.step.models.nnx_bridge import merge_module as merge_module
from jaxsync._src.step.models.nnx_bridge import scan_layers as scan_layers
from jaxsync._src.step.modes import DDP as DDP
from jaxsync._src.step.modes import FSDP as FSDP
from jaxsync._src.step.modes import ZeRO as ZeRO
from jaxsync._src.step.pieces.weighted import WeightedLoss as WeightedLoss
from jaxsync._src.step.pieces.weighted import weighted_loss as weighted_loss
from jaxsync._src.step.skips import AlwaysSkippedWarning as AlwaysSkippedWarning
from jaxsync._src.step.step import TrainStep as TrainStep
from jaxsync._src.step.train_state import TrainState as TrainState
from jaxsync._src.step.unstacked import UnstackedScanWarning as UnstackedScanWarning
from jaxsync._src.sync.collectives import bucket_all_gather as bucket_all_gather
from jaxsync._src.sync.collectives import bucket_all_reduce as bucket_all_reduce
from jaxsync._src.sync.collectives import bucket_reduce_scatter as bucket_reduce_scatter
from jaxsync._src.sync.data_parallel import DataParallel as DataParallel
from jaxsync._src.sync.finalize import ExpertParallel as ExpertParallel
from jaxsync._src.sync.finalize import ParamSync as ParamSync
from jaxsync._src.sync.finalize import SequenceParallel as SequenceParallel
from jaxsync._src.sync.finalize import SyncRules as SyncRules
from jaxsync._src.sync.finalize import Tied as Tied
from jaxsync._src.sync.grad_sync import accumulate_grads as accumulate_grads
from jaxsync._src.sync.grad_sync import all_reduce_grads as all_reduce_grads
from jaxsync._src.sync.grad_sync import broadcast_params as broadcast_params
from jaxsync._src.sync.grad_sync import nonfinite_grads as nonfinite_grads
from jaxsync._src.sync.grad_sync import raise_if_nonfinite as raise_if_nonfinite
from jaxsync._src.sync.grad_sync import sync_grads as sync_grads
from jaxsync._src.sync.grad_sync import value_and_grad as value_and_grad
from jaxsync._src.sync.layer_tap import LayerStack as LayerStack
from jaxsync._src.sync.scan_sync import ShardedGrads as ShardedGrads
from jaxsync._src.sync.views import tap as tap

__version__ = "0.1.0"

__all__ = [
    "GPUS",
    "GPU_PERFORMANCE_OPTIONS",
    "SCHEDULE_OPTIONS",
    "CollectiveTiming",
    "CommunicationBound",
    "ComputationTiming",
    "GpuSpec",
    "ScheduleReport",
    "gpu_target_available",
    "gpu_topology",
    "communication_bound",
    "schedule_report",
    "MemoryReport",
    "PeakBuffer",
    "memory_report",
    "ReplicaMismatch",
    "ReplicaReport",
    "replica_check",
    "Rerun",
    "RerunReport",
    "StragglerReport",
    "Stragglers",
    "KernelBytes",
    "TrafficReport",
    "hbm_bytes",
    "OwnedMatrix",
    "OwnershipReport",
    "PartialSaveWarning",
    "WholeMatrices",
    "muon_labels",
    "ownership_report",
    "whole_matrices",
    "AlwaysSkippedWarning",
    "MultiStepsWarning",
    "UnstackedScanWarning",
    "Bucket",
    "DDP",
    "FSDP",
    "ZeRO",
    "CheckpointMismatchError",
    "Checkpointer",
    "CollectiveSite",
    "CorruptCheckpointError",
    "CollectiveStats",
    "DataParallel",
    "Deterministic",
    "DistributedOptimizer",
    "DistributedOptimizerState",
    "DynamicLossScale",
    "ExpertParallel",
    "FsdpShards",
    "FullyShard",
    "LayerStack",
    "LossScaleState",
    "MixedPrecision",
    "OverlapReport",
    "Restored",
    "RestoredState",
    "SequenceParallel",
    "ShardedGrads",
    "StepMetrics",
    "TrainerMetrics",
    "SyncRules",
    "Tied",
    "TrainState",
    "TrainStep",
    "UnitGrads",
    "WeightedLoss",
    "Buffer",
    "BufferKey",
    "Layout",
    "ParamSlot",
    "ParamSync",
    "PieceRange",
    "ProcessInfo",
    "accumulate_grads",
    "all_reduce_grads",
    "broadcast_params",
    "bucket_all_gather",
    "bucket_all_reduce",
    "bucket_reduce_scatter",
    "build_layout",
    "clip_by_global_norm",
    "collective_stats",
    "distributed_optimizer",
    "fully_shard",
    "host_offload_supported",
    "initialize",
    "linen_scan",
    "lowered_collective_counts",
    "merge_module",
    "nonfinite_grads",
    "nonfinite_report",
    "offload",
    "overlap_report",
    "param_name",
    "normalize_axes",
    "raise_if_nonfinite",
    "scan_layers",
    "shard_batch",
    "sync_grads",
    "tap",
    "train_step",
    "value_and_grad",
    "weighted_loss",
    "with_offloaded_state",
]
