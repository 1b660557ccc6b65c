"""Capture and replay: buckets, static inputs, the ``@graphed`` decorator, the CUDA and
emulated backends. Built on ``graphctl.state``; ``state`` never imports this package."""
from graphctl.graphs.audit import Audit, Finding, audit_graph
from graphctl.graphs.nodes import Node, Ref, Region
from graphctl.graphs.backends import BACKENDS, select_backend, unsupported_reasons
from graphctl.graphs.decorator import graphed
from graphctl.graphs.inputs import DEFAULT_BUCKETS, Buckets, StaticInput
from graphctl.graphs.report import SCHEMA, BucketReport, Report, Segment
from graphctl.graphs.runner import GraphRunner
from graphctl.graphs.target import CaptureTarget, load_target
from graphctl.graphs.verify import Mismatch, VerifyResult

__all__ = ["CaptureTarget", "load_target", "Audit", "Finding", "audit_graph", "Node", "Ref", "Region", "BACKENDS", "DEFAULT_BUCKETS", "SCHEMA", "BucketReport", "Buckets", "GraphRunner", "Report", "Segment",
           "StaticInput", "Mismatch", "VerifyResult", "graphed", "select_backend", "unsupported_reasons"]
