"""The registration presets shipped with regkit: one YAML file per preset, named by its file name (``regkit register
--config brain-mri-3d``). This folder is installed as the package ``regkit.presets`` (``pyproject.toml``:
``package-dir``); :func:`regkit.config.list_presets` lists them."""
