"""The layout constants of the LoRA factors' AMX tile copy (appliance.cpu.lora_tiles), torch-free
so that `appliance plan` (which the console reads) can size the copy without importing torch."""

# The tile update's rank granule: half a tile's K (a rank of 16 reads no zeros).
RANK_GRANULE = 16
# Zero elements after each copy: half a 1 KB tile, which a rank of 16's last block loads past
# its own end (multiplied by the shrink's zeros).
TAIL = 256
