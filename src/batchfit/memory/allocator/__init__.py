"""The CUDA caching allocator, modelled: a trace's requests replayed into segments, blocks and pools.

``caching`` is the allocator model, ``blocks`` its sizes and pieces, ``expandable`` expandable segments;
``stream_replay`` replays a real GPU's recorded events through it and ``snapshot`` writes a trace in
PyTorch's snapshot format.
"""
