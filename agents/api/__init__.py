"""The REST API of the agents app, one module per resource: ``sessions`` (events, export,
stream), ``runs``, ``archives``, ``packages``, ``reclamations``, ``capacity``;
``permissions`` holds the read-permission check they share. Views are thin: input
serializer → service → output serializer.
"""
