"""The trainer's halves of the shard formats, used both ways: a state tree split into tensors and a skeleton
(tree.py; torchpickle.py for the torch.save pickle of Megatron's, DeepSpeed's and the HF Trainer's files), each
format's flatten and decode (codecs.py), tensors out of the bytes a format describes (shardload.py), torch.save
files and pickles read back through the weights-only unpickler and easyckpt's allow-list (safeload.py)."""
