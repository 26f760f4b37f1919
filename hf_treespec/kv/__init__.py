"""The KV caches of the loops: `TargetKV` (the decoding loop's one interface to the target cache), `TreeKV` (one
sequence: committed rows + tree rows; `OneRowKV` is the target's over it), `RaggedKV` (a batch whose rows commit
different lengths), stacked drafter rows (`Drafter.expand_rows`) and sliding-window layers."""
