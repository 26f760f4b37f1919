"""The training objectives: EAGLE / HASS / TALF / TTT / GTO drafter trainers, their losses and unrolling, and the
small policy components' trainers (NDE selector, C2T classifier)."""
