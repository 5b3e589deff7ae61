from __future__ import annotations

from django import forms
from django.contrib import admin

from pooling.models import RECORD_FIELDS, ModelRecord


class ModelRecordForm(forms.ModelForm):
    # Write-only: the stored secret is never rendered back into the page.
    api_key = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="Leave empty to keep the stored credentials. Never shown again once saved.",
    )
    clear_api_key = forms.BooleanField(required=False, help_text="Remove the stored credentials.")

    class Meta:
        model = ModelRecord
        fields = ["owner", *RECORD_FIELDS]

    def save(self, commit: bool = True) -> ModelRecord:
        record = super().save(commit=False)
        if self.cleaned_data.get("clear_api_key"):
            record.api_key = ""
        elif self.cleaned_data.get("api_key"):
            record.api_key = self.cleaned_data["api_key"]
        if commit:
            record.save()
        return record


@admin.register(ModelRecord)
class ModelRecordAdmin(admin.ModelAdmin):
    form = ModelRecordForm
    list_display = ["name", "protocol", "model", "base_url", "owner", "credentials", "updated_at"]
    list_filter = ["protocol", ("owner", admin.EmptyFieldListFilter)]
    search_fields = ["name", "model", "base_url", "owner__username"]
    readonly_fields = ["credentials", "created_at", "updated_at"]
    fields = [
        "owner",
        *RECORD_FIELDS,
        "api_key",
        "clear_api_key",
        "credentials",
        "created_at",
        "updated_at",
    ]

    @admin.display(description="credentials")
    def credentials(self, obj: ModelRecord) -> str:
        return "•••••••• (stored)" if obj.has_credentials else "none"
