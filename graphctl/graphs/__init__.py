"""Capture and replay: buckets, static inputs, the ``@graphed`` decorator and the runner (the
core), the graph backends (``backends/``: CUDA graphs and the emulated recorder) and what
reads a capture afterwards (``analysis/``: nodes, audit, verify, report). Built on
``graphctl.state``; ``state`` never imports this package."""
from graphctl.graphs.analysis.audit import Audit, Finding, audit_graph
from graphctl.graphs.analysis.nodes import Node, Ref, Region
from graphctl.graphs.analysis.report import SCHEMA, BucketReport, Report, Segment
from graphctl.graphs.analysis.verify import Mismatch, VerifyResult
from graphctl.graphs.backends import BACKENDS, GraphBackend, select_backend, unsupported_reasons
from graphctl.graphs.capture.inputs import DEFAULT_BUCKETS, Buckets, StaticInput
from graphctl.graphs.capture.pieces import EagerRegion, eager
from graphctl.graphs.decorator import graphed
from graphctl.graphs.face import Key
from graphctl.graphs.runner import GraphRunner
from graphctl.graphs.target import CaptureTarget
from graphctl.graphs.variants import Variant, VariantRunner

__all__ = ["Audit", "Finding", "audit_graph", "Node", "Ref", "Region", "BACKENDS", "DEFAULT_BUCKETS", "SCHEMA",
           "BucketReport", "Buckets", "CaptureTarget", "GraphBackend", "GraphRunner", "Key", "Report", "Segment",
           "StaticInput", "EagerRegion", "eager", "Mismatch", "Variant", "VariantRunner", "VerifyResult", "graphed",
           "select_backend", "unsupported_reasons"]
