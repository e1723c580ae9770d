"""Routing requests between engine replicas by cached blocks, adapter residency and load."""

from loraplex.gateway.routing.replica_set import ReplicaSetClient
from loraplex.gateway.routing.replica_view import ReplicaView
from loraplex.gateway.routing.router import NoReplicaError, Router, RoutingPolicy

__all__ = ["NoReplicaError", "ReplicaSetClient", "ReplicaView", "Router", "RoutingPolicy"]
