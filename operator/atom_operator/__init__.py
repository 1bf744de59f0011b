"""The ATOM Kubernetes operator: kopf handlers and pure manifest rendering."""
