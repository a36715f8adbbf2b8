"""Helpers shared by the widgets: layer choices, adding ``LayerData`` to a viewer, file fields."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from napari.layers import Layer

if TYPE_CHECKING:
    import napari
    from napari.types import LayerData


def layer_choices(viewer: napari.viewer.Viewer, kind: type[Layer]) -> Callable[[Any], list[tuple[str, Layer]]]:
    """A magicgui ``choices`` callable: the viewer's layers of type ``kind``, by name."""

    def choices(_widget: Any) -> list[tuple[str, Layer]]:
        return [(layer.name, layer) for layer in viewer.layers if isinstance(layer, kind)]

    return choices


def show_layer(viewer: napari.viewer.Viewer, layer_data: LayerData) -> Layer:
    """Add ``(data, meta, layer type)`` to ``viewer``; a layer of the same name is replaced in place (same position
    in the layer list), so that re-running a widget updates its layers instead of piling up copies."""
    data, meta, kind = layer_data
    layer = Layer.create(data, meta, kind)
    name = meta["name"]
    if name in viewer.layers:
        index = viewer.layers.index(name)
        viewer.layers.pop(index)
        viewer.layers.insert(index, layer)
    else:
        viewer.layers.append(layer)
    return layer


def path_or_none(value: object) -> Path | None:
    """A magicgui FileEdit's value, None when the field is empty (magicgui gives ``Path('.')`` for it)."""
    text = str(value or "").strip()
    return None if text in ("", ".") else Path(text)
