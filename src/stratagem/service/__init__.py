"""The cluster service: share a Ray cluster among real Stratagem jobs under a scheduling policy.

``jobfile`` (what users submit) -> ``store`` (SQLite state) -> ``scheduler`` (the loop:
hints in, policy decision, apply) -> ``ray_backend`` (placement groups and replica actors);
``autoscale`` (cost-aware cluster size), ``api`` (control plane and client), ``daemon``,
``cluster`` (up/down); its commands live in :mod:`stratagem.cli.service`. Ray is imported
only where it is used (the ``cluster`` extra). See docs/reference/cluster-service.md.
"""
