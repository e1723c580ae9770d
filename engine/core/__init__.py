"""The engine core and its process.

``EngineCore`` (schedule, run, update: one step), the core process's loop and launch, the typed
messages between a core and its client, the admission checks of a request, and the breadcrumbs a
crash leaves (docs/engine.md).
"""
