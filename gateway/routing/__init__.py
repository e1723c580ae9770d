"""Routing requests between engine replicas by cached blocks, adapter residency and load."""

from loraplex.gateway.routing.replica_view import ReplicaView
from loraplex.gateway.routing.router import NoReplicaError, Router, RoutingPolicy

__all__ = ["NoReplicaError", "ReplicaView", "Router", "RoutingPolicy"]
