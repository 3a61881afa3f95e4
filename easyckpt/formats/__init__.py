"""What the trainer processes and the agent share: the /dev/shm slot layout and its one reader, the
socket protocol's messages, the job key, the manifest, the shard file and the torch.save zip layout.
Definitions and validators; nothing here imports torch."""
