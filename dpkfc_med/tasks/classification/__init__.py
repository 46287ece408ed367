"""Classification of MedMNIST-format images: the task, its metrics and the public probe proxy."""
