"""What the trainer processes and the agent share: the /dev/shm slot layout and its one reader, the
socket protocol's messages, the job key, the manifest, the shard file, the torch.save zip layout and the
save directory's names (layout.py).
Definitions and validators; nothing here imports torch."""
