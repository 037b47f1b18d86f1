"""The layout: the one DeviceMesh (``mesh.py``), the one composition point of every split
(``parallelize.py``), pipeline stages (``pipeline.py``), ring attention for context parallelism
(``ring_attention.py``), FSDP2's comms counted (``collectives.py``), and the DTensor helpers and
gradient tallies the step and the monitors share."""
