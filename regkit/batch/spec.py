"""The batch spec: its YAML schema (:class:`BatchSpec`, with :class:`JobEntry` and :class:`GlobSpec`) and
:func:`load_spec`, which validates a spec (format: :mod:`regkit.batch`) and every input into a
:class:`~regkit.batch.plan.Plan`, with a located message ``FILE:LINE: key.path: message`` for every problem."""

from __future__ import annotations

import csv
import glob as globlib
import io
import os
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from regkit.batch.manifest import MANIFEST
from regkit.batch.plan import INPUT_KEYS, Job, Plan
from regkit.config.layers import DEFAULT_PRESETS, Layer, merge, open_config, read_layers, read_yaml, resolve_paths
from regkit.config.messages import format_path, validate
from regkit.config.schema import RegistrationConfig
from regkit.errors import ConfigError
from regkit.options import KeyPath, Model, Seq, invalid

_LAYOUT_FIELDS = {"out", "fixed_stem", "moving_stem", "fixed_parent", "moving_parent", "index"}
# A job folder's names and path, in bytes: the limits of common file systems (NAME_MAX, PATH_MAX on Linux).
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096
_IMAGE_SUFFIXES = (".nii.gz", ".nii", ".mha", ".mhd", ".nrrd", ".nhdr", ".png")


class JobEntry(Model):
    """One explicit pair of the ``jobs`` list."""

    fixed: str = Field(description="Fixed image: the grid and world space of the outputs.")
    moving: str = Field(description="Moving image, registered to the fixed image.")
    fixed_labels: str | None = Field(default=None, description="Label map of the fixed image (Dice, HD95).")
    moving_labels: str | None = Field(default=None, description="Label map of the moving image, warped.")
    fixed_mask: str | None = Field(default=None, description="Mask on the fixed grid.")
    moving_mask: str | None = Field(default=None, description="Mask on the moving grid.")
    config: str | dict[str, Any] | None = Field(
        default=None, description="A preset/file replacing `defaults`, or a mapping merged over them."
    )


class GlobSpec(Model):
    """Jobs from glob patterns and a pairing rule."""

    pairing: Literal["atlas", "within_folder", "pattern"] = Field(description="How images are paired.")
    images: str | None = Field(default=None, description="Glob of the images (atlas, within_folder).")
    atlas: str | None = Field(default=None, description="The fixed image of every pair (atlas).")
    fixed: str | None = Field(default=None, description="Glob of the fixed images, one `*` (pattern).")
    moving: str | None = Field(default=None, description="Glob of the moving images, one `*` (pattern).")

    @model_validator(mode="after")
    def _keys_of_rule(self) -> GlobSpec:
        needed = {"atlas": ("images", "atlas"), "within_folder": ("images",), "pattern": ("fixed", "moving")}
        for key in ("images", "atlas", "fixed", "moving"):
            given = getattr(self, key) is not None
            if given != (key in needed[self.pairing]):
                verb = "needs" if not given else "does not use"
                raise invalid(f"pairing {self.pairing!r} {verb} {key!r}", (key,))
        if self.pairing == "pattern":
            for key in ("fixed", "moving"):
                if Path(getattr(self, key)).name.count("*") != 1:
                    raise invalid("the file name must hold exactly one '*' (the part that pairs files)", (key,))
        return self


class BatchSpec(Model):
    """A batch of registrations: default configuration, job sources and output layout."""

    defaults: str | dict[str, Any] | None = Field(
        default=None,
        description="A preset name, a config file, or a config mapping; none: regkit's default configuration for "
        "each job's image dimension (regkit.config.DEFAULT_PRESETS).",
    )
    output: str = Field(description="The output root folder.")
    manifest: str | None = Field(
        default=None, description="The manifest file (default: manifest.sqlite in the output root), e.g. on local disk."
    )
    layout: str = Field(default="{out}/{moving_stem}_to_{fixed_stem}", description="Each job's output folder.")
    jobs: Seq[JobEntry] = Field(default=(), description="Explicit pairs.")
    csv: str | None = Field(default=None, description="A CSV of pairs (columns fixed, moving, ...).")
    glob: GlobSpec | None = Field(default=None, description="Pairs from glob patterns.")

    @field_validator("layout")
    @classmethod
    def _layout(cls, layout: str) -> str:
        try:
            parts = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(layout)]
        except ValueError as err:
            raise invalid(f"not a valid layout ({err}; a literal brace is written twice: {{{{ or }}}})") from None
        fields = {name for name, _, _ in parts if name is not None}
        unknown = fields - _LAYOUT_FIELDS
        if unknown:
            raise invalid(f"unknown field {{{sorted(unknown)[0]}}} (fields: {', '.join(sorted(_LAYOUT_FIELDS))})")
        if any(spec or conversion for name, spec, conversion in parts if name is not None):
            raise invalid("fields take no format spec or conversion (write {index}, not {index:03} or {index!r})")
        if not layout.startswith("{out}/"):
            raise invalid("must start with {out}/ (job folders live in the output root)")
        return layout

    @model_validator(mode="after")
    def _sources(self) -> BatchSpec:
        if not self.jobs and self.csv is None and self.glob is None:
            raise invalid("no jobs: give `jobs`, `csv` or `glob`")
        return self


def _stem(path: Path) -> str:
    name = path.name
    for suffix in _IMAGE_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


@dataclass
class _Draft:
    """A job before its configuration is validated: inputs, where each was set, and its config override."""

    inputs: dict[str, Path | None]
    where: dict[str, str]  # input key -> 'FILE:LINE: key.path' for messages
    config: str | dict[str, Any] | None = None
    config_path: KeyPath = ()


class _SpecReader:
    """Turns a parsed spec layer into jobs, with a located message for every problem."""

    def __init__(self, layer: Layer, folder: Path) -> None:
        self.layer, self.folder = layer, folder

    def where(self, path: KeyPath) -> str:
        """``FILE:LINE: key.path`` of ``path`` (or of its nearest parent that was set in the file)."""
        found = next(path[:n] for n in range(len(path), -1, -1) if path[:n] in self.layer.origins)
        label, line = self.layer.origins[found]
        return f"{label}:{line}: {format_path(path) or 'top level'}"

    def path(self, value: str, base: Path | None = None) -> Path:
        """``value`` as an absolute path, relative to ``base`` (default: the spec's folder)."""
        return Path(os.path.abspath((base or self.folder) / Path(value).expanduser()))

    def glob(self, pattern: str, key: KeyPath) -> list[Path]:
        matches = sorted(Path(p) for p in globlib.glob(str(self.path(pattern))))
        if not matches:
            raise ConfigError(f"{self.where(key)}: {pattern!r} matches no file")
        return matches

    def explicit(self, spec: BatchSpec) -> list[_Draft]:
        drafts = []
        for i, entry in enumerate(spec.jobs):
            inputs = {k: None if getattr(entry, k) is None else self.path(getattr(entry, k)) for k in INPUT_KEYS}
            where = {k: self.where(("jobs", i, k)) for k in INPUT_KEYS}
            drafts.append(_Draft(inputs, where, entry.config, ("jobs", i, "config")))
        return drafts

    def from_csv(self, value: str) -> list[_Draft]:
        csv_path = self.path(value)
        where = self.where(("csv",))
        try:
            data = csv_path.read_bytes()
        except OSError as err:
            raise ConfigError(f"{where}: cannot read {csv_path} ({err.strerror})") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise ConfigError(f"{csv_path}:{line}: not a UTF-8 text file") from None
        if "\0" in text:
            line = text.count("\n", 0, text.index("\0")) + 1
            raise ConfigError(f"{csv_path}:{line}: a NUL character (\\0)")
        reader = csv.DictReader(io.StringIO(text, newline=""))
        try:
            columns = reader.fieldnames or []
            unknown = [c for c in columns if c not in INPUT_KEYS]
            missing = [c for c in ("fixed", "moving") if c not in columns]
            if unknown or missing:
                problem = f"unknown column {unknown[0]!r}" if unknown else f"missing column {missing[0]!r}"
                raise ConfigError(f"{csv_path}:1: {problem} (columns: {', '.join(INPUT_KEYS)})")
            drafts = []
            for row in reader:
                line = reader.line_num
                if not row.get("fixed") or not row.get("moving"):
                    raise ConfigError(f"{csv_path}:{line}: fixed and moving must both be given")
                inputs = {k: self.path(row[k], csv_path.parent) if row.get(k) else None for k in INPUT_KEYS}
                drafts.append(_Draft(inputs, {k: f"{csv_path}:{line}: {k}" for k in INPUT_KEYS}))
        except csv.Error as err:
            raise ConfigError(f"{csv_path}:{reader.line_num}: invalid CSV ({err})") from None
        if not drafts:
            raise ConfigError(f"{where}: {csv_path} lists no pairs")
        return drafts

    def from_glob(self, spec: GlobSpec) -> list[_Draft]:
        def draft(fixed: Path, moving: Path, fkey: str, mkey: str) -> _Draft:
            inputs: dict[str, Path | None] = dict.fromkeys(INPUT_KEYS)
            inputs.update(fixed=fixed, moving=moving)
            return _Draft(inputs, {"fixed": self.where(("glob", fkey)), "moving": self.where(("glob", mkey))})

        if spec.pairing == "atlas":
            assert spec.atlas is not None and spec.images is not None  # GlobSpec checked the keys of the rule
            atlas = self.path(spec.atlas)
            return [draft(atlas, image, "atlas", "images") for image in self.glob(spec.images, ("glob", "images"))]
        if spec.pairing == "within_folder":
            assert spec.images is not None
            folders: dict[Path, list[Path]] = {}
            for image in self.glob(spec.images, ("glob", "images")):
                folders.setdefault(image.parent, []).append(image)
            return [
                draft(a, b, "images", "images")
                for images in folders.values()
                for i, a in enumerate(images)
                for b in images[i + 1 :]
            ]
        keyed = {}
        for role in ("fixed", "moving"):
            pattern: str = getattr(spec, role)
            prefix, suffix = Path(pattern).name.split("*")
            files = self.glob(pattern, ("glob", role))
            keyed[role] = {f.name[len(prefix) : len(f.name) - len(suffix)]: f for f in files}
        common = sorted(keyed["fixed"].keys() & keyed["moving"].keys())
        if not common:
            raise ConfigError(f"{self.where(('glob', 'pairing'))}: no fixed and moving files share a '*' part")
        return [draft(keyed["fixed"][k], keyed["moving"][k], "fixed", "moving") for k in common]

    def config_layer(self, value: str | dict[str, Any], key: KeyPath) -> Layer:
        """The configuration layer of a preset/file name or a mapping set at ``key`` in the spec."""
        where = f"{self.where(key)}: "
        if isinstance(value, str):
            return read_layers(open_config(value, self.folder, where), ())
        origins = {p[len(key) :]: o for p, o in self.layer.origins.items() if p[: len(key)] == key}
        data = resolve_paths(value, self.folder)
        if "base" not in data:
            return Layer(data, origins)
        ref = data.pop("base")
        if not isinstance(ref, str):
            raise ConfigError(f"{self.where((*key, 'base'))}: expected a preset name or a file path")
        base = read_layers(open_config(ref, self.folder, f"{self.where((*key, 'base'))}: "), ())
        return merge(base, Layer(data, {p: o for p, o in origins.items() if p[:1] != ("base",)}))


def _check_input(path: Path, where: str) -> int:
    """The image dimension of ``path``; raises a located :class:`ConfigError` unless ``path`` is a DICOM folder (3D)
    or an image whose header reads."""
    import SimpleITK as sitk

    from regkit.errors import GeometryError, ImageReadError
    from regkit.io import format_of
    from regkit.io.preflight import check_text_header, input_kind

    try:  # what read_image checks before a native reader opens the file (name, kind of file, voxel files)
        if input_kind(path, ImageReadError) == "folder":
            return 3
        check_text_header(path, format_of(path, ImageReadError))
    except (ImageReadError, GeometryError) as err:
        raise ConfigError(f"{where}: {err}") from None
    reader = sitk.ImageFileReader()
    reader.SetFileName(str(path))
    try:
        reader.ReadImageInformation()
    except RuntimeError:
        raise ConfigError(f"{where}: cannot read the image header of {path} (corrupt or not an image)") from None
    return int(reader.GetDimension())


def load_spec(spec_path: str | os.PathLike, manifest: str | os.PathLike | None = None) -> Plan:
    """Read and validate a batch spec (:mod:`regkit.batch`) into a :class:`Plan`, checking every input's header.
    ``manifest`` (``--manifest``), relative to the current folder, replaces the spec's ``manifest``.

    Raises :class:`~regkit.errors.ConfigError` ``FILE:LINE: key.path: message`` on the first problem.
    """
    spec_path = Path(spec_path)
    layer = read_yaml(spec_path, str(spec_path))
    spec = validate(BatchSpec, layer)
    folder = spec_path.parent.absolute()
    reader = _SpecReader(layer, folder)
    drafts = reader.explicit(spec)
    if spec.csv is not None:
        drafts += reader.from_csv(spec.csv)
    if spec.glob is not None:
        drafts += reader.from_glob(spec.glob)

    root = reader.path(spec.output)
    real_root = Path(os.path.realpath(root))
    if manifest is not None:
        manifest_path, where = Path(os.path.abspath(manifest)), "--manifest"
    elif spec.manifest is not None:
        manifest_path, where = reader.path(spec.manifest), reader.where(("manifest",))
    else:
        manifest_path, where = root / MANIFEST, reader.where(("output",))
    if manifest_path.is_dir():
        raise ConfigError(f"{where}: the manifest {manifest_path} is a folder; give a file path")
    given = None if spec.defaults is None else reader.config_layer(spec.defaults, ("defaults",))
    default_layers: dict[int, Layer] = {}  # image dimension -> the defaults' layer
    default_configs: dict[int, RegistrationConfig] = {}
    dims: dict[Path, int] = {}
    seen: dict[Path, str] = {}  # real path of a job folder -> the job
    jobs = []
    for index, draft in enumerate(drafts):
        for key in INPUT_KEYS:
            path = draft.inputs[key]
            if path is not None and path not in dims:
                dims[path] = _check_input(path, draft.where[key])
        fixed_path = draft.inputs["fixed"]
        assert fixed_path is not None
        ndim = dims[fixed_path]
        if ndim not in default_layers:
            if given is not None:
                default_layers[ndim] = given
            elif ndim in DEFAULT_PRESETS:
                default_layers[ndim] = reader.config_layer(DEFAULT_PRESETS[ndim], ("defaults",))
            else:
                raise ConfigError(
                    f"{draft.where['fixed']}: {fixed_path} is a {ndim}D image; regkit registers 2D and 3D"
                )
            default_configs[ndim] = validate(RegistrationConfig, default_layers[ndim])
        defaults = default_layers[ndim]
        config = default_configs[ndim]
        if draft.config is not None:
            over = reader.config_layer(draft.config, draft.config_path)
            config = validate(RegistrationConfig, over if isinstance(draft.config, str) else merge(defaults, over))
        fixed, moving = draft.inputs["fixed"], draft.inputs["moving"]
        assert fixed is not None and moving is not None
        out_dir = Path(
            os.path.normpath(
                spec.layout.format(
                    out=root,
                    fixed_stem=_stem(fixed),
                    moving_stem=_stem(moving),
                    fixed_parent=fixed.parent.name,
                    moving_parent=moving.parent.name,
                    index=index,
                )
            )
        )
        real_dir = Path(os.path.realpath(out_dir))
        if out_dir == root or root not in out_dir.parents:
            raise ConfigError(f"{reader.where(('layout',))}: {out_dir} is not a folder inside the output root {root}")
        if real_dir == real_root or real_root not in real_dir.parents:
            raise ConfigError(
                f"{reader.where(('layout',))}: {out_dir} leads to {real_dir} through a symbolic link, which is not "
                f"inside the output root {real_root}"
            )
        name = out_dir.relative_to(root)
        long_names = [part for part in name.parts if len(os.fsencode(part)) > MAX_NAME_BYTES]
        path_bytes = len(os.fsencode(out_dir))
        if long_names or path_bytes > MAX_PATH_BYTES:
            problem = (
                f"the name {long_names[0][:40]!r}... has {len(os.fsencode(long_names[0]))} bytes (at most "
                f"{MAX_NAME_BYTES})"
                if long_names
                else f"its path has {path_bytes} bytes (at most {MAX_PATH_BYTES})"
            )
            raise ConfigError(
                f"{reader.where(('layout',))}: the output folder of job {index} ({fixed.name}, {moving.name}) is too "
                f"long: {problem}"
            )
        if real_dir in seen:
            raise ConfigError(
                f"{draft.where['moving']}: job {index} ({fixed.name}, {moving.name}) has the same output folder "
                f"{out_dir} as {seen[real_dir]}; use a layout with more fields (e.g. {{index}} or {{fixed_parent}})"
            )
        seen[real_dir] = f"job {index} ({fixed.name}, {moving.name})"
        jobs.append(Job(name.as_posix(), draft.inputs, config, out_dir))
    return Plan(spec_path.absolute(), root, jobs, manifest_path)
