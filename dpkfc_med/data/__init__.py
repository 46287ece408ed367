"""Private-data readers: MedMNIST .npz (2D/3D), NIfTI folders / MSD dataset.json, DICOM; data-root resolution."""
