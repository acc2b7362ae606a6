"""Training: self-distilled data from the target, and the MTP, DFly and DFlash trainers."""
