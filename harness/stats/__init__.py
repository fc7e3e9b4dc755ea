"""What the harness measures about β and its effects: the mismatch dials and confidence bins
(`diagnostics`), the SNR split and three-job bounds (`snr`), the repetition detector
(`repetition`), logit noise fitted to a measured β (`fit_noise`), FP8 emulation against real FP8
GEMMs (`fp8_fidelity`)."""
