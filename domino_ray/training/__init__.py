"""Training a Domino (or plain DFlash) draft for a target: data, objective, loop and evaluation."""
