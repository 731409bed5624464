"""The engines and libraries cgbackend lives with: torch.distributed's DDP, FSDP2 and expert
parallelism (distributed.py; the public names are in ``cgbackend.distributed``), modules Dynamo
cannot trace made one opaque graph call each (opaque.py) and Transformer Engine's family of them
(te.py, imported only where Transformer Engine is)."""
