"""The layout: the one DeviceMesh (``mesh.py``), the one composition point of every split
(``parallelize.py``), pipeline stages (``pipeline.py``), FSDP2's comms counted (``collectives.py``)
and each rank's own gradient tallied apart from the summed one (``grad_tally.py``). The model's
own pieces that layouts touch stay beside the model: ring attention (``train/ring_attention.py``)
and the DTensor helpers (``train/dtensors.py``)."""
