"""The console's configuration: a TOML file the console itself keeps up to date. No widgets here.

``meshtui.toml`` in the platformdirs config folder (or ``--config`` / ``MESHTUI_CONFIG``)::

    peers = ["http://10.0.0.2:7071"]     # worker daemons; the console adds and removes these
    theme = "textual-dark"
    poll_seconds = 1.0
    local_layers = "0-14"               # what the local head hosts when peers are configured
    head_port = 7070
    token = "..."                       # the mesh token, when the nodes need one (MESHNET_API_KEY or
                                        # MESHNET_TOKEN wins)
    system_prompt = "You are terse."    # the chat's system prompt (Ctrl+T), kept for the next start

    [keys]                              # binding id -> key(s), shown in the footer
    "chat.cancel" = "escape"

    [chat]                              # sampling defaults for the chat pane
    temperature = 0.0
    max_tokens = 256
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import platformdirs
import tomli_w

from daemon.api import TOKEN_PATTERN, TOKEN_RULE, normalize_url  # normalize_url: the console imports it from here

TOKEN_VARIABLE = "MESHNET_TOKEN"
API_KEY_VARIABLE = "MESHNET_API_KEY"  # the token's conventional name, as meshd reads it too


def default_config_path() -> Path:
    if os.environ.get("MESHTUI_CONFIG"):
        return Path(os.environ["MESHTUI_CONFIG"])
    return Path(platformdirs.user_config_dir("meshnet")) / "meshtui.toml"


def default_export_dir() -> Path:
    """Where the chat's exported conversations go: ``conversations`` in the platformdirs data folder."""
    return Path(platformdirs.user_data_dir("meshnet")) / "conversations"


class ConsoleConfigError(ValueError):
    """The config file cannot be used; the message names the file and the key."""


@dataclass
class ChatSettings:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    seed: int | None = None

    def params(self) -> dict:
        """OpenAI request parameters for these settings."""
        params = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "max_tokens": self.max_tokens}
        return params | ({"seed": self.seed} if self.seed is not None else {})


@dataclass
class ConsoleConfig:
    peers: list[str] = field(default_factory=list)
    theme: str | None = None
    poll_seconds: float = 1.0
    local_layers: str | None = None
    head_port: int = 7070
    token: str | None = field(default=None, repr=False)  # from the file; mesh_token() is the one used
    keys: dict[str, str] = field(default_factory=dict)
    chat: ChatSettings = field(default_factory=ChatSettings)
    system_prompt: str | None = None
    path: Path | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, path: Path | None = None) -> ConsoleConfig:
        """Read the file if it exists; a missing file is the defaults."""
        path = path or default_config_path()
        if not path.exists():
            return cls(path=path)
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, OSError) as exc:
            raise ConsoleConfigError(f"{path}: {exc}") from None
        known = {"peers", "theme", "poll_seconds", "local_layers", "head_port", "token", "keys", "chat",
                 "system_prompt"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConsoleConfigError(f"{path}: unknown keys {unknown}; known keys are {sorted(known)}")
        try:
            chat = ChatSettings(**data.pop("chat", {}))
            config = cls(**data, chat=chat, path=path)
        except TypeError as exc:
            raise ConsoleConfigError(f"{path}: {exc}") from None
        if not isinstance(config.peers, list) or not all(isinstance(p, str) for p in config.peers):
            raise ConsoleConfigError(f"{path}: peers must be a list of URLs")
        if not isinstance(config.keys, dict) or not all(isinstance(v, str) for v in config.keys.values()):
            raise ConsoleConfigError(f"{path}: [keys] maps binding ids to key names")
        if config.system_prompt is not None and not isinstance(config.system_prompt, str):
            raise ConsoleConfigError(f"{path}: system_prompt must be a string")
        if config.token is not None and not (isinstance(config.token, str) and TOKEN_PATTERN.fullmatch(config.token)):
            raise ConsoleConfigError(f"{path}: token must be {TOKEN_RULE}")
        return config

    def mesh_token(self, environ: dict[str, str] | None = None) -> str | None:
        """The token the console sends: ``MESHNET_API_KEY`` or ``MESHNET_TOKEN`` if set, else the file's
        ``token``, else none.

        The environment wins, as it does for meshd; the token is never a command-line option (``ps`` shows those).
        """
        environ = os.environ if environ is None else environ
        given = {name: environ[name] for name in (API_KEY_VARIABLE, TOKEN_VARIABLE) if environ.get(name)}
        if not given:
            return self.token
        for name, token in given.items():
            if not TOKEN_PATTERN.fullmatch(token):
                raise ConsoleConfigError(f"{name} must be {TOKEN_RULE}")
        if len(set(given.values())) > 1:
            raise ConsoleConfigError(f"{API_KEY_VARIABLE} and {TOKEN_VARIABLE} are set to different keys: set one")
        return next(iter(given.values()))

    def save(self) -> None:
        """Write the file atomically (the operator may be editing peers from two consoles)."""
        path = self.path or default_config_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in asdict(self).items() if k != "path" and v is not None}
        data["chat"] = {k: v for k, v in data["chat"].items() if v is not None}
        tmp = path.with_suffix(".toml.tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), "w") as file:
            if self.token:  # a file holding the mesh token is for its owner's eyes only
                os.fchmod(file.fileno(), 0o600)
            file.write(tomli_w.dumps(data))
        tmp.replace(path)

    def add_peer(self, url: str) -> bool:
        """Remember a peer and save; False if it was already known."""
        url = normalize_url(url)
        if url in self.peers:
            return False
        self.peers.append(url)
        self.save()
        return True

    def remove_peer(self, url: str) -> bool:
        url = normalize_url(url)
        if url not in self.peers:
            return False
        self.peers.remove(url)
        self.save()
        return True
