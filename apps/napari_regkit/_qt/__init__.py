"""The plugin's Qt widgets (private): the registration dock widget and the inspect widget (``napari.yaml``)."""

from napari_regkit._qt._inspect import InspectWidget
from napari_regkit._qt._registration import RegistrationWidget

__all__ = ["InspectWidget", "RegistrationWidget"]
