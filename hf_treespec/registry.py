"""A tiny name -> class registry, so policies, verifiers and drafter adapters are looked up by name, not if/elif."""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to classes. ``get`` raises a ValueError that lists the valid names."""

    def __init__(self, kind: str, plural: str | None = None):
        self.kind = kind
        self.plural = plural or f"{kind}s"  # "tree policies", not "tree policys"
        self._entries: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def decorator(cls: type[T]) -> type[T]:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = cls
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return decorator

    def unregister(self, name: str) -> None:
        """Removes ``name`` (a plugin or a test that registered a temporary entry)."""
        self.get(name)  # the usual error for an unknown name
        del self._entries[name]

    def get(self, name: str) -> type[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"Unknown {self.kind} {name!r}. Valid {self.plural}: {', '.join(sorted(self._entries))}."
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))
